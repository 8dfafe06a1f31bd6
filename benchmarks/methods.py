"""What the benchmarks measure: the registry of methods and the one call that
dispatches to them, ``(B, N, H, D)`` in and out, with one pattern.

* ``ours`` — ``ring_attention.dilated_attention`` (and the ring, for
  ``bench.py ring-run``; ``ours.py``);
* ``gather`` — :func:`gather_sdpa_dilated`: for every branch and head-offset
  class ``o = h mod r`` the active rows of each segment are compacted, PyTorch's
  fused SDPA runs on the compacted segments, the results are scattered back and
  merged by their log-sum-exp. Exact (the multiset softmax of
  ``ra.dilated_attention``) and differentiable: its backward runs SDPA's fused
  backward per chunk with the *final* merged ``out`` and ``lse``, as ring and
  flash attention do (``gather.py``, on ``sdpa.py``'s kernels);
* ``fa4`` — the same gather and merge with flash-attn-4 (``flash_attn.cute``,
  the CuTe-DSL FlashAttention for Hopper and Blackwell) in place of SDPA, on
  CUDA where it is installed (``ring_attention.local.backends.fa4_interface``);
* ``flex`` — :class:`FlexDilated`: one FlexAttention call with a ``mask_mod``
  for reachability and a ``score_mod`` adding ``log(multiplicity)`` (how many
  branches reach the pair), under which an ordinary softmax is the multiset
  softmax: exact. Its ``BlockMask`` is built from the pattern's block structure
  (:func:`flex_block_mask`, checked against ``create_block_mask``;
  ``flex.py``);
* ``dense`` — plain SDPA over all n² pairs. The same function only for the
  dense pattern ``[(w >= n, 1)]``: otherwise a cost reference (``sdpa.py``).

The pattern's exact work (pairs, FLOPs) is ``work.py``'s. Every
``ring_attention`` name the benchmarks use is imported where it is used
(``ours.py``, ``work.py``, ``gather.py``), lazily, so that the baselines still
run when the extension failed to build (the pattern, its geometry and the
planner's pair count need no extension). The public names of those files are
re-exported here: the benchmarks reach them all as ``methods.<name>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .flex import (
    FLEX_BLOCK,
    FlexDilated,
    flex_block_mask,
    flex_block_state,
    flex_mods,
    flex_visited_pairs,
    reference_block_state,
)
from .gather import branch_classes, gather_sdpa_dilated
from .ours import exchange_counters, layout_pieces, plan_bytes_sent, ring_attention, ring_call
from .sdpa import SDPA_BACKENDS, dense_sdpa, sdpa_with_lse
from .work import dense_pairs, flops, pattern_pairs

__all__ = [
    "FLEX_BLOCK",
    "LONGNET_DILATIONS",
    "LONGNET_SEGMENTS",
    "METHODS",
    "SAME_FUNCTION",
    "SDPA_BACKENDS",
    "FlexDilated",
    "Methods",
    "branch_classes",
    "default_methods",
    "dense_pairs",
    "dense_sdpa",
    "exchange_counters",
    "flex_block_mask",
    "flex_block_state",
    "flex_mods",
    "flex_visited_pairs",
    "flops",
    "gather_sdpa_dilated",
    "layout_pieces",
    "pattern_pairs",
    "plan_bytes_sent",
    "reference_block_state",
    "ring_attention",
    "ring_call",
    "sdpa_with_lse",
]

LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_DILATIONS = (1, 2, 4, 6, 12)
METHODS = ("ours", "gather", "fa4", "flex", "dense")
SAME_FUNCTION = ("ours", "gather", "fa4", "flex")  # compute ra.dilated_attention exactly


def default_methods(device: torch.device) -> list[str]:
    """What ``bench.py local`` and ``check`` run unless told: every method,
    flash-attn-4 only on CUDA (where it is reported unsupported unless it
    imports)."""
    return [m for m in METHODS if m != "fa4" or device.type == "cuda"]


class Methods:
    """Calls every method on ``(B, N, H, D)`` inputs with one pattern."""

    def __init__(self, segs, dils, causal: bool, device: torch.device, flex_compiled: bool = True):
        self.segs, self.dils, self.causal, self.device = list(segs), list(dils), causal, device
        self.flex_compiled = flex_compiled
        self._flex: FlexDilated | None = None
        try:
            self.ra, self.ra_error = ring_attention(), None
        except Exception as exc:  # the extension may have failed to build: baselines still run
            self.ra, self.ra_error = None, f"{type(exc).__name__}: {exc}"

    def backends(self, method: str, sdpa_backends: Sequence[str]) -> list[str | None]:
        """The kernels tried for ``method``: each CUDA SDPA backend for gather
        and dense (the fastest is kept), else one (``None``)."""
        if method in ("gather", "dense") and self.device.type == "cuda":
            return list(sdpa_backends)
        if method == "fa4":
            return ["fa4"]
        return [None]

    def unsupported(self, method: str, backward: bool) -> str | None:
        """Why ``method`` cannot run this case (None when it can)."""
        if method == "flex" and self.device.type == "cpu" and backward:
            return "FlexAttention has no backward on the CPU (torch raises NotImplementedError)"
        if method == "fa4":
            if self.device.type != "cuda":
                return "flash-attn-4 runs on CUDA GPUs only"
            from ring_attention.local.backends import fa4_missing  # loads the extension

            missing = fa4_missing()
            if missing:
                return f"flash-attn-4 not importable ({missing})"
        return None

    def dense_is_pattern(self, n: int) -> bool:
        return len(self.segs) == 1 and self.dils[0] == 1 and self.segs[0] >= n

    def ours_paths(self, q, k, v) -> dict[str, str | None]:
        """Which path ``ours`` takes on these inputs (ring_attention/local/dispatch.py):
        ``{"forward": "kernel" | "dense", "backward": ... | None}`` (None: no
        backward; K/V assumed finite)."""
        from ring_attention.local.dispatch import route

        pattern = self.ra.Pattern(self.segs, self.dils, causal=self.causal)
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        paths: dict[str, str | None] = {"forward": None, "backward": None}
        for p in ("forward", "backward") if grad else ("forward",):
            paths[p] = "dense" if route(p, q, k, v, pattern, None).dense else "kernel"
        return paths

    def call(self, method: str, backend: str | None, q, k, v, return_lse: bool = False):
        if method == "ours":
            if self.ra is None:
                raise RuntimeError(f"ring_attention not importable: {self.ra_error}")
            return self.ra.dilated_attention(
                q, k, v, self.segs, self.dils, causal=self.causal, return_lse=return_lse
            )
        if method in ("gather", "fa4"):
            return gather_sdpa_dilated(
                q, k, v, self.segs, self.dils, self.causal, return_lse=return_lse, backend=backend
            )
        if method == "flex":
            if self._flex is None:
                self._flex = FlexDilated(self.segs, self.dils, self.causal, self.flex_compiled)
            # compiled flex on the CPU returns no LSE
            lse_ok = self.device.type != "cpu" or not self.flex_compiled
            if return_lse and not lse_ok:
                return self._flex(q, k, v), None
            return self._flex(q, k, v, return_lse=return_lse)
        if method == "dense":
            out = dense_sdpa(q, k, v, self.causal, backend)
            return (out, None) if return_lse else out
        raise ValueError(f"unknown method {method!r}")
