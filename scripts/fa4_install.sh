#!/usr/bin/env bash
# On the GPU machine: unpack the parts of flash-attn-4 that scripts/fa4_wheels.sh
# made (.fa4/a, .fa4/b; each call carries one) into build/fa4, which stays
# while the machine is warm, and install once both have arrived:
#
#   bash scripts/fa4_install.sh          # unpack what this call carried; install when complete
#   source <(bash scripts/fa4_install.sh --env)   # PYTHONPATH for the installed copy
#   bash scripts/fa4_install.sh --stand-in DIR    # stand-in parts for a dry run: DIR/call1/a,
#                                                 # DIR/call2/b (a tiny flash_attn.cute, cutlass)
#
# Exit status: 0 installed (and flash_attn.cute imports), 3 a part is still
# missing (the message says which), 1 anything else.
# Environment: FA4_PARTS (default .fa4), FA4_DEST (default build/fa4), PYTHON.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PARTS=${FA4_PARTS:-.fa4}
DEST=$(realpath -m "${FA4_DEST:-build/fa4}")
SITE=$DEST/site
PY=${PYTHON:-python3}
# The DSL adds its packages to sys.path from a .pth file, which PYTHONPATH
# entries do not run: name the folder too.
PATHS="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
if [[ "${1:-}" == "--env" ]]; then
  echo "export PYTHONPATH=$PATHS\${PYTHONPATH:+:\$PYTHONPATH}"
  exit 0
fi
if [[ "${1:-}" == "--stand-in" ]]; then
  "$PY" - "${2:?--stand-in needs a folder}" <<'EOF'
import io, lzma, os, sys, tarfile, zipfile
root = sys.argv[1]
a, b = os.path.join(root, "call1", "a"), os.path.join(root, "call2", "b")
os.makedirs(a, exist_ok=True)
os.makedirs(b, exist_ok=True)
big = "./nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_cutlass_ir.cu13.so"
open(os.path.join(a, "path.txt"), "w").write(big + "\n")
open(os.path.join(a, "cutlass_ir.so.xz"), "wb").write(lzma.compress(b"stand-in module"))
with zipfile.ZipFile(os.path.join(b, "stand_in-1.0-py3-none-any.whl"), "w") as whl:
    whl.writestr("flash_attn/__init__.py", "")
    whl.writestr("flash_attn/cute/__init__.py", "__version__ = 'stand-in'\n")
with tarfile.open(os.path.join(b, "libs_cu13_rest.tar.xz"), "w:xz") as tar:
    info = tarfile.TarInfo("./nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py")
    tar.addfile(info, io.BytesIO(b""))
print("fa4_install: stand-in parts in", root)
EOF
  exit $?
fi
mkdir -p "$DEST/a" "$DEST/b"
for part in a b; do
  if ls "$PARTS/$part"/* >/dev/null 2>&1; then
    # a part replaces what an earlier call left, and the install is redone
    rm -rf "${DEST:?}/$part" "$SITE/.complete" && mkdir -p "$DEST/$part" || exit 1
    cp -f "$PARTS/$part"/* "$DEST/$part/" || exit 1
    echo "fa4_install: part $part received"
  fi
done
for part in a b; do
  if ! ls "$DEST/$part"/* >/dev/null 2>&1; then
    echo "fa4_install: part $part missing: carry $PARTS/$part (made by scripts/fa4_wheels.sh) in a call on this machine"
    exit 3
  fi
done
if [[ ! -f $SITE/.complete ]]; then
  rm -rf "$SITE"
  mkdir -p "$SITE"
  "$PY" - "$DEST" "$SITE" <<'EOF' || exit 1
import glob, lzma, os, sys, tarfile, zipfile
dest, site = sys.argv[1:]
for whl in sorted(glob.glob(os.path.join(dest, "b", "*.whl"))):
    zipfile.ZipFile(whl).extractall(site)
with tarfile.open(os.path.join(dest, "b", "libs_cu13_rest.tar.xz")) as tar:
    tar.extractall(site, filter="tar")
rel = open(os.path.join(dest, "a", "path.txt")).read().strip()
target = os.path.join(site, rel)
os.makedirs(os.path.dirname(target), exist_ok=True)
with lzma.open(os.path.join(dest, "a", "cutlass_ir.so.xz")) as src, open(target, "wb") as out:
    while chunk := src.read(1 << 24):
        out.write(chunk)
os.chmod(target, 0o755)
for so in glob.glob(os.path.join(site, "**", "*.so"), recursive=True):
    os.chmod(so, 0o755)
print("fa4_install: unpacked into", site)
EOF
  touch "$SITE/.complete"
fi
export PYTHONPATH=$PATHS${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import flash_attn.cute as fa, cutlass; print("fa4_install: flash_attn.cute imports from", fa.__file__, "cutlass-dsl", getattr(cutlass, "__version__", "?"))' || exit 1
