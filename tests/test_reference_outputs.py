"""Every path's outputs bit for bit equal to the stored ones
(tests/reference_outputs.py: the local op, the ring, Ulysses, the hybrid,
cached decoding and the MHA module, forward and backward, on fixed inputs,
under pinned CPU kernels)."""

from __future__ import annotations

import json

import reference_outputs


def test_outputs_equal_the_stored_ones():
    stored = json.loads(reference_outputs.DATA.read_text())
    got = reference_outputs.compute_pinned()
    diffs = [
        f"{group}/{case}/{name}: stored {want}, now {got[group][case].get(name)}"
        for group, cases in stored.items()
        for case, outputs in cases.items()
        for name, want in outputs.items()
        if got[group][case].get(name) != want
    ]
    assert got.keys() == stored.keys()
    assert not diffs, "\n".join(diffs)
