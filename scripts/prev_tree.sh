#!/usr/bin/env bash
# The sources of an earlier commit, for measuring our kernels against their
# previous version in the same run (gpu_check.sh builds it beside this
# checkout and its `kernels` stage times both): exports setup.py,
# pyproject.toml, csrc/ and ring_attention/ of REF into DEST (default .prev,
# git-ignored, about 1 MB) and writes REF's full hash to DEST/SOURCE_COMMIT.
# The benchmarks of this checkout then time that tree's extension when
# PYTHONPATH names DEST, and record its commit (benchmarks/measure.py).
#
#   bash scripts/prev_tree.sh REF [DEST]
#
# On the device tool, carry DEST with the call that runs gpu_check.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ref=${1:?usage: scripts/prev_tree.sh REF [DEST]}
dest=${2:-.prev}
commit=$(git rev-parse --verify "$ref^{commit}")
rm -rf "$dest"
mkdir -p "$dest"
git archive "$commit" setup.py pyproject.toml csrc ring_attention | tar -x -C "$dest"
echo "$commit" >"$dest/SOURCE_COMMIT"
echo "prev_tree: $(git log -1 --format='%h %s' "$commit" | cut -c1-100)"
echo "prev_tree: $dest ($(du -sh "$dest" | cut -f1))"
