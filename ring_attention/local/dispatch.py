"""Which path the local op takes (:data:`PATHS`) and which dense backend each per-branch call
takes (:data:`BACKENDS`), each row citing its measurement (docs/design.md §5: when our kernels
run instead); ``python -m ring_attention.info`` prints the route of a shape and why."""

from dataclasses import dataclass

import torch

from ..core import config
from ..core.cache import LRUCache
from ..core.pattern import Pattern
from .backends import aligned, cudnn_missing, fa4_missing
from .spans import Route, plan_spans

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

#: More dense calls than this in one pass (documents: calls per document
#: span) take our kernels, which handle documents in one launch per branch.
MAX_CALLS = 4096


@dataclass(frozen=True)
class PathRow:
    """``auto`` takes the dense path for this pass, device and dtype at these head dims
    (``None``: any) from ``min_rows`` rows."""

    pass_: str
    device: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None
    min_rows: int
    source: str


PATHS = (
    PathRow(
        "backward", "cuda", (F16, BF16), None, 0,
        "H200 2026-11-27 (journal/2026-11-27-gpu-h200-views.md): the dense backward per branch "
        "on strided views made forward+backward 1.6-3.1x faster than 9cf198c's default "
        "(32K-1M, 12 x 64 and 16 x 128; FlashAttention-2 or flash-attn-4); earlier, on an "
        "H100, FlashAttention-2's backward per branch beat our backward kernel 1.5-1.6x",
    ),
    PathRow(
        "forward", "cuda", (F16, BF16), (128,), 0,
        "H200 2026-11-27: at head_dim 128 the dense forward per branch took 4.1 / 10.4 / 84.5 ms "
        "with flash-attn-4 and 5.5 / 18.4 / 145.4 ms with FlashAttention-2 against our "
        "kernel's 9.8 / 18.4 / 145.8 ms (n = 32K / 131K / 1M, 16 x 128)",
    ),
    PathRow(
        "forward", "cuda", (F16, BF16), (64,), 131072,
        "H200 2026-11-27: at head_dim 64 from 131072 rows the dense forward per branch took "
        "5.3 / 40.0 ms with flash-attn-4 and 8.8 / 65.6 ms with FlashAttention-2 against our "
        "kernel's 12.2 / 92.7 ms (n = 131K / 1M, 12 x 64); at 32K our kernel was as fast "
        "(3.5 ms against 3.5 and 5.0)",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class BackendRow:
    """A dense backend and the calls it takes, forward and backward (device, dtypes, head dims,
    capability, rows multiple, GQA)."""

    backend: str
    device: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None
    head_dim_multiple: int
    head_dim_max: int
    min_capability: tuple[int, int]
    rows_multiple: int
    gqa: bool
    source: str


BACKENDS = (
    BackendRow(
        "fa4", "cuda", (F16, BF16), (64, 96, 128), 8, 128, (9, 0), 1, True,
        "flash-attn-4 4.0.0b36 (CuTe DSL) on the strided views: checked against the float64 "
        "oracle and 1.6-1.9x faster than FlashAttention-2 per branch (H200 2026-11-27; "
        "journal/2026-11-27-gpu-h200-views.md)",
    ),
    BackendRow(
        "cudnn", "cuda", (F16, BF16), None, 8, 128, (9, 0), 128, False,
        "cuDNN through ATen: the fastest gather forward at 16 x 128, 32K (H100, seventh); its "
        "forward on the views matched the float64 oracle (H200 2026-11-27, n = 10240); its "
        "backward per branch was 1.65-1.73x our kernel's speed against FlashAttention-2's "
        "1.49-1.50x (H100 2026-11-25, journal/2026-11-25-gpu-h100-first-runs.md) but "
        "disagreed with the oracle on ragged lengths (n 70-300): only rows a multiple of 128, "
        "no GQA; the backward at those rows is not yet run on a GPU (its arguments read from "
        "ATen's schema and source, checked on the CPU against an emulation)",
    ),
    BackendRow(
        "flash", "cuda", (F16, BF16), None, 8, 256, (8, 0), 1, True,
        "PyTorch's FlashAttention-2: per branch on an H100 (2026-11-25/26), checked against "
        "the float64 oracle",
    ),
    BackendRow(
        "cpu", "cpu", (F32, F64, F16, BF16), None, 1, 1 << 30, (0, 0), 1, True,
        "PyTorch's CPU flash attention: the stand-in that runs the whole path on the CPU "
        "(tests); our CPU kernels are faster (benchmarks/RESULTS.md), so auto never takes it",
    ),
)  # fmt: skip


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _fits(row: BackendRow, device, dtype, d, cc, rows, gqa, missing) -> str | None:
    """Why ``row`` cannot run the call (None when it can)."""
    if row.device != device.type:
        return f"runs on {row.device}"
    if dtype not in row.dtypes:
        return f"no {dtype}"
    if (row.head_dims is not None and d not in row.head_dims) or (
        d % row.head_dim_multiple or d > row.head_dim_max
    ):
        return f"no head_dim {d}"
    if cc < row.min_capability:
        return f"needs sm_{row.min_capability[0]}{row.min_capability[1]}"
    if rows % row.rows_multiple:
        return f"call rows {rows} not a multiple of {row.rows_multiple}"
    if gqa and not row.gqa:
        return "no grouped K/V heads"
    return dict(missing).get(row.backend)


#: Why optional backends cannot run: ``((name, reason), ...)``.
Unavailable = tuple[tuple[str, str], ...]


def unavailable() -> Unavailable:
    """The backends of the table this process cannot run and why (read on every call; part of the
    route caches' keys)."""
    out = []
    if why := fa4_missing():
        out.append(("fa4", "not installed" if why.startswith("ModuleNotFoundError")
                    else f"no import ({why})"))  # fmt: skip
    if why := cudnn_missing():
        out.append(("cudnn", why))
    return tuple(out)


def choose_backend(
    pass_: str, named: str, device, dtype, d: int, cc, rows: int, gqa: bool,
    missing: Unavailable | None = None,
) -> tuple[str | None, str]:  # fmt: skip
    """The first backend of :data:`BACKENDS` (``named`` first) that runs a call of ``rows`` rows
    (every one runs both passes ``pass_``), and why each one before it cannot."""
    missing = unavailable() if missing is None else missing
    reasons = []
    for r in sorted(BACKENDS, key=lambda r: r.backend != named):  # (stable: the table's order)
        why_not = _fits(r, device, dtype, d, cc, rows, gqa, missing)
        if why_not is None:
            return r.backend, "; ".join(reasons)
        reasons.append(f"{r.backend}: {why_not}")
    return None, "; ".join(reasons)


def _mode_why(pass_: str, mode: str, device, dtype, d: int, n: int) -> str | Route:
    """Why ``mode`` takes the dense path, or the kernel's route where ``auto`` finds no row."""
    if mode != "auto":
        return f"{config.FORWARD if pass_ == 'forward' else config.BACKWARD}={mode}"
    rows = (r for r in PATHS if r.pass_ == pass_ and r.device == device.type and dtype in r.dtypes)
    for row in rows:
        if (row.head_dims is None or d in row.head_dims) and n >= row.min_rows:
            return f"auto: {row.source}"
    what = f"{device.type} {dtype} head_dim {d} n {n}"
    return Route(False, f"auto: no row of the path table for {what}")


def route(
    pass_: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern,
    key_padding_mask: torch.Tensor | None, head_range: tuple[int, int, int] = (0, 0, 0),
) -> Route:  # fmt: skip
    """The route of ``pass_`` of the local op on these inputs (``head_range``: ``(head_start,
    total_heads, total_kv_heads)``); reads the environment."""
    if torch.compiler.is_compiling():
        return Route(False, "traced by torch.compile: the graph keeps the operator")
    mode = config.forward_mode() if pass_ == "forward" else config.backward_mode()
    named = config.dense_backend()
    rows = config.span_rows()
    if mode == "kernel":
        return Route(False, f"{config.FORWARD if pass_ == 'forward' else config.BACKWARD}=kernel")
    if key_padding_mask is not None:
        return Route(False, "a key padding mask")
    if pattern.windowed:
        return Route(False, "a sliding window")
    if q.numel() == 0 or k.numel() == 0:
        return Route(False, "empty inputs")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return Route(False, "a head dim that is not contiguous")
    if q.device.type == "cuda" and not all(aligned(t) for t in (q, k, v)):
        return Route(False, MISALIGNED)
    _, n, heads, d = q.shape
    device, cc = q.device, _capability(q.device)
    key = (pass_, mode, named, rows, device, cc, q.dtype, n, heads, k.shape[2], d, pattern,
           head_range, unavailable())  # fmt: skip
    return _ROUTES.get(key, lambda: decide(*key))


def decide(
    pass_: str, mode: str, named: str, rows: int, device: torch.device, cc: tuple[int, int],
    dtype: torch.dtype, n: int, heads: int, kv_heads: int, d: int, pattern: Pattern,
    head_range: tuple[int, int, int] = (0, 0, 0), missing: Unavailable | None = None,
) -> Route:  # fmt: skip
    """:func:`route` from the values it reads (no tensors: the tables alone; ``missing``:
    :func:`unavailable`, ``None``: this process's)."""
    missing = unavailable() if missing is None else missing
    why = _mode_why(pass_, mode, device, dtype, d, n)
    if isinstance(why, Route):
        return why
    spans = plan_spans(pattern, n, heads, kv_heads, rows, head_range)
    if spans.calls > MAX_CALLS:
        return Route(False, f"{spans.calls} dense calls a pass (more than {MAX_CALLS})")
    shapes = [[(c.rows, c.q_heads, c.kv_heads) for c in span.calls] for span in spans.spans]
    chosen: dict[tuple[int, int, int], str] = {}
    for n_rows, hq, hk in dict.fromkeys(s for span in shapes for s in span):  # calls' order
        name, reasons = choose_backend(
            pass_, named, device, dtype, d, cc, n_rows, hq != hk, missing
        )
        if name is None:
            what = f"{n_rows} rows, {hq}/{hk} heads"
            return Route(False, f"no dense backend for a call of {what} ({reasons})")
        chosen[n_rows, hq, hk] = name
    per_span = tuple(tuple(chosen[s] for s in span) for span in shapes)
    used = sorted(set(chosen.values()))
    return Route(True, f"{why}; backends {', '.join(used)}", spans, per_span)


_ROUTES: LRUCache[Route] = LRUCache(64, name="dense routes")

MISALIGNED = (
    "a view not 16-byte aligned or with strides not multiples of 8 elements "
    "(the dense backends would copy it)"
)


#: Why ``auto`` keeps the ring's dilated blocks (segments crossing the pieces) on our kernels.
DILATED_AUTO = (
    "auto: no row of the path table for the ring's dilated blocks (segments crossing the "
    "pieces: their GPU speed not yet measured; RING_ATTENTION_FORWARD/BACKWARD=dense runs them "
    "densely)"
)


def block_shape(pattern: Pattern, n: int, boundaries: tuple[int, ...]) -> tuple[str | None, str]:
    """What the ring's blocks are, and why: ``"dense"`` (plain dense attention), ``"local"`` (every
    segment inside one piece), ``"dilated"`` (segments crossing the pieces) or ``None`` (ours)."""
    if pattern.documents is not None:
        return None, "documents"
    if pattern.windowed:
        return None, "a sliding window"
    (w, r), *others = pattern.branches
    if not others and r == 1 and w >= n:
        return "dense", "plain dense attention"
    if all(b % w == 0 for b in boundaries if 0 < b < n for w in pattern.segment_lengths):
        return "local", "every segment inside one piece"
    return "dilated", "segments crossing the pieces"


def may_be_dense(pass_: str, dtype: torch.dtype, d: int, n: int, shape: str = "dense") -> bool:
    """Whether the ring's blocks of ``pass_`` (:func:`block_shape`'s ``shape``) may take the dense
    path on some rank: from values every rank agrees on (the handshake's), whatever its device."""
    mode = config.forward_mode() if pass_ == "forward" else config.backward_mode()
    if mode != "auto":
        return mode == "dense"
    return shape == "dense" and any(r.pass_ == pass_ and dtype in r.dtypes and n >= r.min_rows
               and (r.head_dims is None or d in r.head_dims) for r in PATHS)  # fmt: skip


def route_blocks(
    pass_: str, q: torch.Tensor, k: torch.Tensor, pattern: Pattern, n: int,
    boundaries: tuple[int, ...], rows: int,
) -> Route:  # fmt: skip
    """The route of the ring's per-step blocks in ``pass_``, and why (``backends``: ``((name,),)``
    for every call, ``()``: each piece by :func:`route`); ``rows``: a divisor of every piece."""
    mode = config.forward_mode() if pass_ == "forward" else config.backward_mode()
    if mode == "kernel":
        return Route(False, f"{config.FORWARD if pass_ == 'forward' else config.BACKWARD}=kernel")
    shape, why = block_shape(pattern, n, boundaries)
    if shape is None:
        return Route(False, why)
    if shape == "local":
        return Route(True, f"{why}: each piece's block by the local op's route")
    if shape == "dilated" and mode == "auto":
        return Route(False, DILATED_AUTO)
    _, _, heads, d = q.shape
    rows = rows if shape == "dense" else 1
    key = (pass_, mode, config.dense_backend(), q.device, _capability(q.device), q.dtype, n, heads,
           k.shape[2], d, rows, unavailable())  # fmt: skip
    return _BLOCK_ROUTES.get(key, lambda: decide_blocks(*key))


def decide_blocks(
    pass_: str, mode: str, named: str, device: torch.device, cc: tuple[int, int],
    dtype: torch.dtype, n: int, heads: int, kv_heads: int, d: int, rows: int,
    missing: Unavailable | None = None,
) -> Route:  # fmt: skip
    """:func:`route_blocks` from the values it reads (the tables alone)."""
    why = _mode_why(pass_, mode, device, dtype, d, n)
    if isinstance(why, Route):
        return why
    gqa = heads != kv_heads
    name, reasons = choose_backend(pass_, named, device, dtype, d, cc, rows, gqa, missing)
    if name is None:
        return Route(False, f"no dense backend for the ring's blocks ({reasons})")
    return Route(True, f"{why}; backend {name}", None, ((name,),))


_BLOCK_ROUTES: LRUCache[Route] = LRUCache(64, name="ring block routes")
