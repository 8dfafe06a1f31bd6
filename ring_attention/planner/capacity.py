"""A configuration's numbers at one sequence length, and the searches over
lengths and rank counts."""

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..core import config
from ..core.checks import check_int
from ..core.geometry import MAX_SEQ_LEN, head_groups
from ..core.links import Link
from ..core.pattern import Pattern, as_flag
from .memory import DTYPE_BYTES, LayerMemory, layer_memories, own_memory
from .model import model_memory, model_step_seconds
from .presets import PATTERNS, ModelShape
from .throughput import Rates, assumed_rates, dtype_name, rates_from_records
from .timing import RankTime, layer_times
from .traffic import MAX_WORLD_SIZE, Traffic, predict_traffic


@dataclass(frozen=True)
class Setup:
    """Everything but the sequence length: ranks, memory, inputs, pattern,
    rates, link and model."""

    ranks: int  # processes (one per GPU)
    device: str  # "cuda" or "cpu"
    memory: int  # bytes per rank
    reserve: int  # bytes kept free of them
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: str
    pattern: str | None = "longnet"
    segments: tuple[int, ...] | None = None
    dilations: tuple[int, ...] | None = None
    causal: bool = False
    head_groups: bool = False
    head_offsets: str = "modulo"
    document_length: int | None = None  # documents of this many tokens, back to back
    layout: str = "contiguous"
    records: tuple[dict, ...] | None = None  # benchmark records (.throughput)
    tflops: tuple[float, float] | None = None  # (forward, forward+backward), over the rates
    threads: int = 1  # CPU threads per process (the assumed CPU rate scales with it)
    link: Link = field(default_factory=lambda: Link(400.0, 10.0))
    matmul_tflops: float | None = None  # the whole model's dense rate (None: assumed)
    model: ModelShape | None = None
    checkpointing: bool = True  # whole-model options (.model)
    shard_params: bool = True
    source: str = "auto"  # where the exchanged rows come from (.traffic.predict_traffic)
    far_bytes: int = 0  # transfers of at most this many K/V bytes in the far group (0: none)
    window: tuple[int, int] | None = None  # the ring's exact plans count it, not closed forms
    backward_heads: str = "all"  # the backward's heads per group, or auto: the most that fit

    def __post_init__(self) -> None:
        for name in ("causal", "head_groups", "checkpointing", "shard_params"):
            as_flag(getattr(self, name), name)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the inputs."""
        return DTYPE_BYTES[dtype_name(self.dtype)]

    @property
    def usable(self) -> int:
        """Bytes per rank the plan may use."""
        return self.memory - self.reserve

    def pattern_at(self, seq_len: int) -> Pattern:
        """The pattern at ``seq_len`` (presets grow with it; explicit segments and
        dilations do not), with documents of ``document_length``."""
        if self.segments or self.dilations:
            if not (self.segments and self.dilations):
                raise ValueError("--segments and --dilations go together")
            segs, dils = list(self.segments), list(self.dilations)
        elif self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {self.pattern!r}")
        else:
            segs, dils = PATTERNS[self.pattern][1](seq_len)
        pattern = Pattern(segs, dils, causal=self.causal, head_groups=self.head_groups,
                          head_offsets=self.head_offsets, window=self.window)  # fmt: skip
        if self.document_length:
            if self.document_length < 1:
                raise ValueError(f"document_length must be >= 1, got {self.document_length}")
            cuts = list(range(0, seq_len, self.document_length)) + [seq_len]
            pattern = pattern.with_documents(cuts if seq_len else [0])
        return pattern

    def rates(self, local_len: int) -> Rates:
        """Kernel rates for calls on ``local_len`` rows."""
        if self.tflops is not None:
            f, b = self.tflops
            return Rates(f * 1e12, b * 1e12, f"given: {f:g} / {b:g} TFLOP/s (--tflops)")
        found = self.records and rates_from_records(
            list(self.records), n=max(local_len, 1), heads=self.heads, head_dim=self.head_dim,
            dtype=self.dtype, device=self.device)  # fmt: skip
        return found or assumed_rates(self.device, self.dtype, self.threads)

    def matmul_rate(self, rates: Rates) -> tuple[float, str]:
        """Dense matmul FLOP/s for the whole model, and where it comes from."""
        if self.matmul_tflops is not None:
            return self.matmul_tflops * 1e12, f"given: {self.matmul_tflops:g} TFLOP/s"
        if self.device == "cpu":
            return rates.forward, "the attention forward rate (CPU)"
        return 400e12, "ASSUMED 400 TFLOP/s (bf16 GEMMs at ~40-60% of an H100's peak)"


@dataclass(frozen=True, eq=False)
class Evaluation:
    """A setup at one sequence length: traffic, memory and time per rank."""

    setup: Setup
    seq_len: int
    pattern: Pattern
    traffic: Traffic

    @cached_property
    def memories(self) -> list[LayerMemory]:
        """Every rank's attention layer memory."""
        return self.memories_with(self.group_heads)

    def memories_with(self, group_heads: int) -> list[LayerMemory]:
        """Every rank's attention layer memory, the backward by groups of ``group_heads``."""
        s = self.setup
        return layer_memories(self.traffic, s.batch, s.head_dim, s.itemsize, device=s.device,
                              far_bytes=s.far_bytes, group_heads=group_heads)  # fmt: skip

    @cached_property
    def group_heads(self) -> int:
        """Query heads per group of the ring's backward (0: every head at once): the setup's
        ``RING_ATTENTION_BACKWARD_HEADS``; ``auto``: the planner's advice, the fastest (then the
        most heads: the fewest groups and transfers) whose training peak fits the usable
        memory, else the fewest. More groups are faster only where a group's far dK/dV hide
        behind the next group's local blocks."""
        s = self.setup
        r = s.heads // s.kv_heads
        if s.backward_heads != "auto":
            return config.backward_heads(s.heads, r, s.itemsize, s.backward_heads)
        groups = range(1, s.heads // r + 1)  # whole K/V heads' groups: at least r heads
        sizes = sorted({math.ceil(math.ceil(s.heads / k) / r) * r for k in groups}, reverse=True)

        def slowest(size: int) -> float:
            return max(t.forward_backward for t in self.times_with(s.far_bytes, size % s.heads))

        for size in sorted(sizes, key=lambda size: (slowest(size), -size)):
            per = size % s.heads  # (every head: 0)
            if max(m.training_peak for m in self.memories_with(per)) <= s.usable:
                return per
        return sizes[-1] % s.heads

    @cached_property
    def rates(self) -> Rates:
        """Kernel rates at the longest local length."""
        return self.setup.rates(int(self.traffic.local_len.max()))

    @cached_property
    def times(self) -> list[RankTime]:
        """Every rank's predicted layer time (the setup's schedule)."""
        return self.times_with(self.setup.far_bytes)

    def times_with(self, far_bytes: int, group_heads: int | None = None) -> list[RankTime]:
        """Every rank's predicted layer time with the far group's threshold ``far_bytes``
        (0: the ring alone), the backward by groups of ``group_heads`` (default: the setup's)."""
        s = self.setup
        per = self.group_heads if group_heads is None else group_heads
        groups = len(head_groups(s.heads, s.heads // s.kv_heads, per))
        return layer_times(self.traffic, s.batch, s.head_dim, s.itemsize, self.rates, s.link,
                           far_bytes, groups)  # fmt: skip

    def worst(self, key: Callable[[int], float]) -> int:
        """The rank maximising ``key(rank)``."""
        return max(range(self.setup.ranks), key=key)

    @property
    def forward_peak(self) -> int:
        """Worst rank's peak of an inference forward of one layer."""
        return max(m.forward_peak for m in self.memories)

    @property
    def training_peak(self) -> int:
        """Worst rank's peak of forward + backward of one layer."""
        return max(m.training_peak for m in self.memories)

    def model_items(self, rank: int) -> dict[str, int]:
        """Whole-model memory items of ``rank`` (a model must be set)."""
        s = self.setup
        assert s.model is not None
        tokens = s.batch * int(self.traffic.local_len[rank])
        return model_memory(s, self.memories[rank], tokens, s.ranks)

    @property
    def model_peak(self) -> int:
        """Worst rank's whole-model training peak."""
        return max(sum(self.model_items(j).values()) for j in range(self.setup.ranks))

    def model_seconds(self) -> dict[str, float]:
        """Whole-model step time of the slowest rank, per item."""
        s = self.setup
        assert s.model is not None
        rank = self.worst(lambda j: self.times[j].forward_backward)
        t = self.times[rank]
        rate, _ = s.matmul_rate(self.rates)
        tokens = s.batch * int(self.traffic.local_len.max())
        return model_step_seconds(s, tokens, t.forward, t.forward_backward, rate)


def evaluate(setup: Setup, seq_len: int) -> Evaluation:
    """The :class:`Evaluation` of ``setup`` at ``seq_len`` tokens."""
    if not isinstance(setup, Setup):
        raise ValueError(f"setup must be a Setup, got {type(setup).__name__}")
    seq_len = check_int(seq_len, "seq_len", 0, MAX_SEQ_LEN)
    pattern = setup.pattern_at(seq_len)
    s = setup
    tr = predict_traffic(pattern, seq_len, s.heads, s.kv_heads, s.ranks, s.layout, source=s.source)
    return Evaluation(setup, seq_len, pattern, tr)


Peak = Callable[[Evaluation], int]


def largest_length(
    setup: Setup, peak: Peak, *, rel_tol: float = 0.005,
    cache: dict[int, Evaluation] | None = None,
    progress: Callable[[int, bool], None] | None = None,
) -> Evaluation | None:  # fmt: skip
    """The longest sequence whose ``peak`` fits in ``setup.usable`` (``None``
    when one token per rank does not fit; docs/planner.md)."""
    p, budget = setup.ranks, setup.usable
    cache = {} if cache is None else cache

    def over(ev: Evaluation) -> int:  # <= 0: fits
        return peak(ev) - budget

    def at(n: int) -> Evaluation:
        if n not in cache:
            cache[n] = evaluate(setup, n)
            if progress is not None:
                progress(n, over(cache[n]) <= 0)
        return cache[n]

    lo = at(p)
    if over(lo) > 0:
        return None
    prev: Evaluation | None = None  # the fitting length before lo
    hi: Evaluation | None = None  # the shortest length seen not to fit

    def tried(ev: Evaluation) -> None:
        nonlocal lo, hi, prev
        if over(ev) <= 0:
            if ev.seq_len > lo.seq_len:
                prev, lo = lo, ev
        elif hi is None or ev.seq_len < hi.seq_len:
            hi = ev

    for _ in range(40):  # unbracketed: follow the line through two fitting lengths
        if hi is not None:
            break
        cand = 1024 * lo.seq_len
        if prev is not None:
            slope = (over(lo) - over(prev)) / (lo.seq_len - prev.seq_len)
            if slope > 0:
                cand = int(1.01 * (lo.seq_len - over(lo) / slope))
        tried(at(min(max(cand, lo.seq_len + p), 1024 * lo.seq_len, MAX_SEQ_LEN)))
    while hi is not None and hi.seq_len - lo.seq_len > max(p, rel_tol * lo.seq_len):
        # the line through lo and hi meets the budget at est: try just below and above it
        width = hi.seq_len - lo.seq_len
        est = lo.seq_len + width * -over(lo) / (over(hi) - over(lo))
        for cand in (est * (1 - rel_tol / 3), est * (1 + rel_tol / 3)):
            cand = min(max(int(cand), lo.seq_len + 1), hi.seq_len - 1)
            if lo.seq_len < cand < hi.seq_len:
                tried(at(cand))
        if hi.seq_len - lo.seq_len > width / 2:  # the line misled: bisect once
            mid = (lo.seq_len + hi.seq_len) // 2
            if lo.seq_len < mid < hi.seq_len:
                tried(at(mid))
    return lo


def fewest_ranks(
    setup: Setup, seq_len: int, peak: Peak, *, rel_tol: float = 0.02, limit: int = MAX_WORLD_SIZE,
    progress: Callable[[int, bool], None] | None = None,
) -> Evaluation | None:  # fmt: skip
    """The fewest ranks at which ``seq_len`` tokens fit, or ``None`` when more
    than ``limit`` would be needed (docs/planner.md)."""
    budget = setup.usable
    limit = check_int(limit, "limit", 1, MAX_WORLD_SIZE)

    def at(p: int) -> Evaluation:
        ev = evaluate(replace(setup, ranks=p), seq_len)
        if progress is not None:
            progress(p, peak(ev) <= budget)
        return ev

    one, two = at(1), at(2)
    for ev in (one, two):
        if peak(ev) <= budget:
            return ev
    lo, hi, best = 2, None, None  # lo does not fit, hi fits
    last = (1, peak(one))
    p = min(max(-(-peak(one) // budget), 3), limit)
    width = None
    while True:
        ev = at(p)
        y = peak(ev)
        if y <= budget:
            hi, best = p, ev
        else:
            lo = p
        if hi is None and lo >= limit:
            return None
        if hi is not None and hi - lo <= max(1, int(rel_tol * hi) if hi > 50 else 1):
            return best
        est = _meets(last, (p, y), budget)
        last = (p, y)
        if hi is None:  # above the estimate (or 25 % more), to bracket
            cand = max(lo + 1, int(1.25 * lo) + 1 if est is None else int(est * 1.003) + 1)
            p = min(cand, limit)
            continue
        halved = width is None or hi - lo <= width / 2
        width = hi - lo
        cand = (lo + hi) // 2 if est is None or not halved else round(est)
        p = cand if lo < cand < hi else (lo + hi) // 2


def _meets(a: tuple[int, int], b: tuple[int, int], budget: int) -> float | None:
    """Where ``y = u + v / p`` through ``a`` and ``b`` meets ``budget`` (or ``None``)."""
    (p1, y1), (p2, y2) = a, b
    if p1 == p2:
        return None
    v = (y1 - y2) / (1 / p1 - 1 / p2)
    u = y1 - v / p1
    return v / (budget - u) if v > 0 and budget > u else None


def floor_peak(setup: Setup, seq_len: int, ranks: int, goal: str) -> int:
    """A closed-form lower bound of the worst rank's peak for ``goal`` at
    ``ranks`` ranks (:func:`.memory.own_memory`)."""
    local = -(-seq_len // ranks)
    s = setup
    m = own_memory(local, s.heads, s.kv_heads, s.batch, s.head_dim, s.itemsize)
    if goal == "inference":
        return m.forward_peak
    if goal == "training":
        return m.training_peak
    if s.model is None:
        raise ValueError(f"goal must be inference or training without a model, got {goal!r}")
    return sum(model_memory(s, m, s.batch * local, ranks).values())


def floor_ranks(setup: Setup, seq_len: int, goal: str, high: int = MAX_SEQ_LEN) -> int | None:
    """The fewest ranks (up to ``high``, else ``None``) at which
    :func:`floor_peak` fits, by bisection: a lower bound of :func:`fewest_ranks`."""

    def fits(ranks: int) -> bool:
        return floor_peak(setup, seq_len, ranks, goal) <= setup.usable

    if fits(1):  # (one rank gathers no weights: from two on, more ranks never need more)
        return 1
    at = bisect.bisect_left(range(2, high + 1), True, key=fits)
    return 2 + at if at < high - 1 else None
