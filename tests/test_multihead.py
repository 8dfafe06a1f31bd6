"""MultiheadDilatedAttention with a pattern, a group or a compute_dtype.

With a pattern the module is checked against the float64 oracle of
docs/design.md §1 (outputs, exact attention weights, gradients, masks on top of
the pattern, dropout, bias/zero keys); with ``group=`` against the unsharded
module, in real gloo processes. tests/test_mha_dropin.py compares the module
with nn.MultiheadAttention itself.
"""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch
import torch.nn as nn
from op_helpers import assert_max_abs
from oracle import multiplicity, reference_attention

import ring_attention as ra
from ring_attention.core import multiplicity as ra_multiplicity
from ring_attention.core.multiplicity import PATTERN_CACHE, log_multiplicity
from ring_attention.core.multiplicity import multiplicity as pattern_multiplicity
from ring_attention.core.pattern import Pattern
from ring_attention.nn import multihead as ra_multihead
from ring_attention.nn.multihead import MultiheadAttentionError, MultiheadDilatedAttention
from ring_attention.parallel.testing import run_distributed

E, H = 16, 4


def pair(seed: int = 0, **kw) -> tuple[nn.MultiheadAttention, MultiheadDilatedAttention]:
    """An nn.MultiheadAttention and a MultiheadDilatedAttention with its weights."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kw)
    mine = MultiheadDilatedAttention(E, H, **kw)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def seq(batch_first: bool, b: int, n: int, e: int, **kw) -> torch.Tensor:
    return torch.randn(b, n, e, **kw) if batch_first else torch.randn(n, b, e, **kw)


# ---------------------------------------------------------------------------
# Parameters and state dicts.


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"bias": False},
        {"add_bias_kv": True, "add_zero_attn": True},
        {"kdim": 8, "vdim": 12},
        {"kdim": 8, "vdim": 12, "bias": False, "add_bias_kv": True, "batch_first": True},
    ],
)
def test_parameters_and_init_match_nn_mha(kw) -> None:
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(E, H, **kw)
    torch.manual_seed(3)
    mine = MultiheadDilatedAttention(E, H, segment_lengths=[4, 8], dilation_rates=[1, 2], **kw)
    a, b = ref.state_dict(), mine.state_dict()
    assert list(a) == list(b)
    for name in a:  # same names, shapes and (same seed) the same initial values
        assert torch.equal(a[name], b[name]), name
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in mine.named_parameters()]
    assert type(mine.out_proj) is type(ref.out_proj)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "batch_first", "dropout",
                 "add_zero_attn", "_qkv_same_embed_dim"):  # fmt: skip
        assert getattr(mine, attr) == getattr(ref, attr), attr

    # Load both ways.
    torch.manual_seed(4)
    other = nn.MultiheadAttention(E, H, **kw)
    mine.load_state_dict(other.state_dict())
    ref.load_state_dict(mine.state_dict())
    for name, t in other.state_dict().items():
        assert torch.equal(ref.state_dict()[name], t)


# ---------------------------------------------------------------------------
# Dilated patterns.

PATTERNS = [([4], [2]), ([4, 8], [1, 2]), ([3, 6, 12], [1, 2, 4])]


def reference_mha(m: MultiheadDilatedAttention, x, *, causal=False, kpm=None):
    """Projections by hand, attention by the float64 oracle. x: (B, L, E)."""
    B, L, _ = x.shape
    D = m.head_dim
    q, k, v = nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
    heads = [t.reshape(B, L, m.num_heads, D).double() for t in (q, k, v)]
    out, lse = reference_attention(
        *heads, m.segment_lengths, m.dilation_rates, causal=causal,
        head_groups=m.head_groups, key_padding_mask=kpm,
    )  # fmt: skip
    y = m.out_proj(out.reshape(B, L, -1).to(x.dtype))
    return y, heads, lse


def oracle_weights(m, heads, lse, *, causal=False, kpm=None):
    """M[h, t, u] * exp(s_tu - lse_t): the exact weights of the multiset softmax."""
    q, k, _ = heads
    B, L, Hh, D = q.shape
    mult = multiplicity(L, Hh, m.segment_lengths, m.dilation_rates, causal, m.head_groups)
    mult = mult.expand(B, Hh, L, L).clone()
    if kpm is not None:
        mult = mult * (~kpm).double()[:, None, None, :]
    s = torch.einsum("bthd,buhd->bhtu", q, k) * D**-0.5
    w = mult * torch.exp(s - lse[..., None])
    return torch.where(mult > 0, w, torch.zeros_like(w))


@pytest.mark.parametrize("segs,dils", PATTERNS)
@pytest.mark.parametrize("head_groups", [False, True])
def test_pattern_matches_oracle(segs, dils, head_groups) -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, H, batch_first=True, dtype=torch.float64,
                                  segment_lengths=segs, dilation_rates=dils,
                                  head_groups=head_groups)  # fmt: skip
    B, L = 2, 21
    x = torch.randn(B, L, E, dtype=torch.float64)
    kpm = torch.rand(B, L) < 0.25
    for kp in (None, kpm):
        ref, heads, lse = reference_mha(m, x, kpm=kp)
        fast, none = m(x, x, x, key_padding_mask=kp, need_weights=False)
        assert none is None
        assert_max_abs(fast, ref, 1e-10, "fast path")
        dense, w = m(x, x, x, key_padding_mask=kp, average_attn_weights=False)
        assert_max_abs(dense, ref, 1e-10, "dense path")
        assert_max_abs(w, oracle_weights(m, heads, lse, kpm=kp), 1e-10, "weights")
        _, wavg = m(x, x, x, key_padding_mask=kp)
        assert_max_abs(wavg, w.mean(dim=1), 1e-12)
        if kp is not None:  # float key_padding_mask: dense path, same result
            fl = kp.double().masked_fill(kp, float("-inf"))
            assert_max_abs(m(x, x, x, key_padding_mask=fl, need_weights=False)[0], ref, 1e-10)


def test_pattern_seq_first_and_unbatched() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, H, dtype=torch.float64, segment_lengths=[4, 8],
                                  dilation_rates=[1, 2])  # fmt: skip
    x = torch.randn(13, 2, E, dtype=torch.float64)  # (L, B, E)
    ref, _, _ = reference_mha(m, x.transpose(0, 1))
    assert_max_abs(m(x, x, x, need_weights=False)[0], ref.transpose(0, 1), 1e-10)
    o, w = m(x[:, 0], x[:, 0], x[:, 0])
    assert o.shape == (13, E) and w.shape == (13, 13)
    assert_max_abs(o, ref[0], 1e-10)


def test_pattern_causal_hint_and_masks() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, H, batch_first=True, dtype=torch.float64,
                                  segment_lengths=[4, 8], dilation_rates=[1, 2])  # fmt: skip
    B, L = 2, 16
    x = torch.randn(B, L, E, dtype=torch.float64)
    causal_mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    ref, heads, lse = reference_mha(m, x, causal=True)
    # Hint used: causal pattern via the op, the mask is not read.
    hint, _ = m(x, x, x, attn_mask=torch.zeros(L, L), is_causal=True, need_weights=False)
    assert_max_abs(hint, ref, 1e-10)
    # Weights needed: the mask is applied on top of the (non-causal) pattern.
    dense, w = m(x, x, x, attn_mask=causal_mask, is_causal=True, average_attn_weights=False)
    assert_max_abs(dense, ref, 1e-10)
    assert_max_abs(w, oracle_weights(m, heads, lse, causal=True), 1e-10)
    bool_mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert_max_abs(m(x, x, x, attn_mask=bool_mask, need_weights=False)[0], ref, 1e-10)
    # A float attn_mask is added to the scores of the pattern.
    am = torch.randn(L, L, dtype=torch.float64)
    _, w2 = m(x, x, x, attn_mask=am, average_attn_weights=False)
    logm = torch.log(multiplicity(L, H, [4, 8], [1, 2]))
    q, k, _ = heads
    s = torch.einsum("bthd,buhd->bhtu", q, k) * m.head_dim**-0.5 + am + logm
    assert_max_abs(w2, torch.softmax(s, dim=-1), 1e-10)


def test_pattern_rows_reaching_nothing_are_zero_not_nan() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, H, batch_first=True, segment_lengths=[4], dilation_rates=[1])
    x = torch.randn(1, 8, E, requires_grad=True)
    kpm = torch.zeros(1, 8, dtype=torch.bool)
    kpm[0, :4] = True  # the first segment reaches nothing
    for nw in (False, True):
        out, w = m(x, x, x, key_padding_mask=kpm, need_weights=nw)
        expect = m.out_proj.bias.expand(4, E)
        assert torch.isfinite(out).all()
        assert_max_abs(out[0, :4], expect)
        if nw:
            assert (w[0, :4] == 0).all()
        x.grad = None
        out.sum().backward()
        assert torch.isfinite(x.grad).all()


def test_pattern_gradients_fast_equals_dense() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, H, batch_first=True, dtype=torch.float64,
                                  segment_lengths=[4, 8], dilation_rates=[1, 2])  # fmt: skip
    x = torch.randn(2, 19, E, dtype=torch.float64, requires_grad=True)
    grads = []
    for nw in (False, True):
        x.grad = None
        m.zero_grad()
        out, _ = m(x, x, x, need_weights=nw)
        (
            out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        ).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for g1, g2 in zip(*grads, strict=True):
        assert_max_abs(g1, g2, 1e-10)


def test_pattern_with_bias_kv_and_zero_attn() -> None:
    """The extra keys are reached once by every query."""
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, H, batch_first=True, dtype=torch.float64, add_bias_kv=True,
                                  add_zero_attn=True, segment_lengths=[4],
                                  dilation_rates=[2])  # fmt: skip
    B, L = 2, 8
    x = torch.randn(B, L, E, dtype=torch.float64)
    out, w = m(x, x, x, average_attn_weights=False)
    assert w.shape == (B, H, L, L + 2)
    assert_max_abs(w.sum(-1), torch.ones(B, H, L, dtype=torch.float64), 1e-12)
    q, k, v = nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
    k = torch.cat([k, m.bias_k.expand(B, 1, E), torch.zeros(B, 1, E, dtype=x.dtype)], 1)
    v = torch.cat([v, m.bias_v.expand(B, 1, E), torch.zeros(B, 1, E, dtype=x.dtype)], 1)
    sh = lambda t: t.reshape(B, t.shape[1], H, -1).transpose(1, 2)  # noqa: E731
    logm = torch.nn.functional.pad(torch.log(multiplicity(L, H, [4], [2])), (0, 2))
    s = sh(q) @ sh(k).transpose(-1, -2) * m.head_dim**-0.5 + logm
    p = torch.softmax(s, -1)
    assert_max_abs(w, p, 1e-12)
    expect = m.out_proj((p @ sh(v)).transpose(1, 2).reshape(B, L, E))
    assert_max_abs(out, expect, 1e-12)
    assert_max_abs(m(x, x, x, need_weights=False)[0], expect, 1e-12)


def test_pattern_dropout_is_reproducible_and_drops_probabilities() -> None:
    m = MultiheadDilatedAttention(E, H, dropout=0.5, batch_first=True, segment_lengths=[4, 8],
                                  dilation_rates=[1, 2])  # fmt: skip
    x = torch.randn(2, 16, E)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(m(x, x, x, average_attn_weights=False))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    m.eval()
    _, w_eval = m(x, x, x, average_attn_weights=False)
    w_train = runs[0][1]
    kept = w_train != 0
    reached = w_eval != 0
    assert not (kept & ~reached).any()  # nothing outside the pattern appears
    assert_max_abs(w_train[kept], w_eval[kept] * 2)  # survivors scaled by 1 / (1 - p)
    frac = kept.sum() / reached.sum()
    assert 0.35 < frac < 0.65
    torch.manual_seed(11)
    o_nw, _ = m.train()(x, x, x, need_weights=False)  # no weights: still dropout
    assert (o_nw - m.eval()(x, x, x)[0]).abs().max() > 1e-3


def test_pattern_equals_dense_when_it_covers_everything() -> None:
    ref, _ = pair(batch_first=True)
    m = MultiheadDilatedAttention(E, H, batch_first=True, segment_lengths=[64], dilation_rates=[1])
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 12, E)
    for nw in (False, True):
        o1, w1 = ref(x, x, x, need_weights=nw)
        o2, w2 = m(x, x, x, need_weights=nw)
        assert_max_abs(o2, o1)
        assert_max_abs(w2, w1)


def test_transformer_encoder_layer_runs_the_pattern() -> None:
    """nn.TransformerEncoderLayer's fused inference kernel would compute dense
    attention from the weights; the module's pre-hook keeps it from doing so."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    dense = layer.self_attn
    layer.self_attn = MultiheadDilatedAttention(E, H, batch_first=True, segment_lengths=[4],
                                                dilation_rates=[2])  # fmt: skip
    layer.self_attn.load_state_dict(dense.state_dict())
    layer.eval()
    x = torch.randn(2, 12, E)
    with torch.no_grad():
        fast = layer(x)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = layer(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        layer.self_attn = dense
        dense_out = layer(x)
    assert_max_abs(fast, slow)
    assert (fast - dense_out).abs().max() > 1e-3


def test_plain_module_is_nn_mha_and_compute_dtype_uses_the_op(monkeypatch) -> None:
    """No pattern: nn.MultiheadAttention's own forward (no call into this
    package). With compute_dtype, dense self-attention without weights runs
    the C++ op with one segment covering the sequence."""
    calls = []
    real = ra_multihead.attend

    def spy(*args, **kw):
        p = args[3]
        calls.append((p.segment_lengths[0] >= 11, p.dilation_rates))
        return real(*args, **kw)

    monkeypatch.setattr(ra_multihead, "attend", spy)
    ref, plain = pair(batch_first=True)
    x = torch.randn(2, 11, E)
    kpm = torch.rand(2, 11) < 0.3
    kpm[:, 0] = False
    o1, _ = ref(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert_max_abs(plain(x, x, x, key_padding_mask=kpm, need_weights=False)[0], o1)
    assert calls == []
    mine = MultiheadDilatedAttention(E, H, batch_first=True, compute_dtype=torch.float32)
    mine.load_state_dict(ref.state_dict())
    o2, w = mine(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert w is None and calls == [(True, (1,))]
    assert_max_abs(o2, o1)
    mine(x, x, x, need_weights=True)  # weights: dense path, no op call
    assert len(calls) == 1


# ---------------------------------------------------------------------------
# Dtype policy.


def test_compute_dtype() -> None:
    torch.manual_seed(0)
    kw = dict(batch_first=True, segment_lengths=[4, 8], dilation_rates=[1, 2])
    base = MultiheadDilatedAttention(E, H, **kw)
    x = torch.randn(2, 16, E)
    ref = base(x, x, x, need_weights=False)[0]
    for cd in ("auto", torch.float32):  # CPU: "auto" is float32
        m = MultiheadDilatedAttention(E, H, compute_dtype=cd, **kw)
        m.load_state_dict(base.state_dict())
        assert torch.equal(m(x, x, x, need_weights=False)[0], ref)
    assert ra.select_dtype("cpu") == torch.float32
    m = MultiheadDilatedAttention(E, H, compute_dtype=torch.bfloat16, **kw)
    m.load_state_dict(base.state_dict())
    for nw in (False, True):
        out, w = m(x, x, x, need_weights=nw)
        assert out.dtype == torch.float32
        assert w is None or w.dtype == torch.float32
        assert_max_abs(out, ref, 3e-2)
    # A float64 module computing attention in float32.
    m64 = MultiheadDilatedAttention(E, H, dtype=torch.float64, compute_dtype=torch.float32, **kw)
    m64.load_state_dict(base.state_dict())
    out = m64(x.double(), x.double(), x.double(), need_weights=False)[0]
    assert out.dtype == torch.float64
    assert_max_abs(out.float(), ref, 1e-5)


# ---------------------------------------------------------------------------
# Pattern cache.


def test_repeated_call_hits_the_pattern_cache() -> None:
    m = MultiheadDilatedAttention(E, H, batch_first=True, segment_lengths=[4, 8],
                                  dilation_rates=[1, 2])  # fmt: skip
    x = torch.randn(1, 10, E)
    PATTERN_CACHE.clear()
    m(x, x, x)
    assert PATTERN_CACHE.info() == {
        "hits": 0,
        "misses": 1,
        "size": 1,
        "maxsize": PATTERN_CACHE.maxsize,
    }
    w1 = m(x, x, x)[1]
    w2 = m(x, x, x)[1]
    info = PATTERN_CACHE.info()
    assert (info["hits"], info["misses"], info["size"]) == (2, 1, 1)  # built nothing
    assert torch.equal(w1, w2)
    m(x, x, x, need_weights=False)  # fast path: no dense pattern at all
    assert PATTERN_CACHE.info()["misses"] == 1
    y = torch.randn(1, 11, E)
    m(y, y, y)  # another length: another entry
    assert PATTERN_CACHE.info()["misses"] == 2


def test_pattern_cache_is_bounded_and_thread_safe(monkeypatch) -> None:
    small = ra_multiplicity.LRUCache(maxsize=3)
    monkeypatch.setattr(ra_multiplicity, "PATTERN_CACHE", small)
    for n in range(1, 6):
        log_multiplicity(Pattern([2], [1]), n, 2)
    assert small.info() == {"hits": 0, "misses": 5, "size": 3, "maxsize": 3}

    small.clear()
    results, barrier = [], threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        results.append(log_multiplicity(Pattern([4, 8], [1, 2]), 33, 4))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is results[0] for r in results)
    assert small.info()["misses"] == 1 and small.info()["hits"] == 7


def test_pattern_multiplicity_matches_oracle() -> None:
    for segs, dils in PATTERNS:
        for causal, hg in itertools.product([False, True], [False, True]):
            pattern = Pattern(segs, dils, causal=causal, head_groups=hg)
            got = pattern_multiplicity(pattern, 23, 5, dtype=torch.float64)
            assert torch.equal(got, multiplicity(23, 5, segs, dils, causal, hg))


# ---------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"segment_lengths": [4]}, "segment_lengths and dilation_rates"),
        ({"dilation_rates": [1]}, "segment_lengths and dilation_rates"),
        ({"segment_lengths": [], "dilation_rates": []}, "segment_lengths"),
        ({"segment_lengths": [4, 8], "dilation_rates": [1]}, "same length"),
        ({"segment_lengths": [4], "dilation_rates": [5]}, r"dilation_rates\[0\]"),
        ({"segment_lengths": [0], "dilation_rates": [1]}, r"segment_lengths\[0\]"),
        (
            {"segment_lengths": [2] * 5, "dilation_rates": [1] * 5, "head_groups": True},
            "head_groups",
        ),
        ({"compute_dtype": "fast"}, "compute_dtype"),
        ({"compute_dtype": torch.int32}, "compute_dtype"),
        # floating, but no kernel takes them (they failed in forward)
        ({"compute_dtype": torch.float8_e4m3fn}, 'compute_dtype must be None, "auto" or one of'),
        ({"compute_dtype": torch.float8_e5m2}, "compute_dtype"),
        ({"compute_dtype": torch.complex64}, "compute_dtype"),
    ],
)
def test_constructor_errors(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        MultiheadDilatedAttention(E, H, **kw)


def test_forward_errors() -> None:
    """nn.MultiheadAttention's words and exception types; its AssertionErrors
    are also ValueErrors here."""
    m = MultiheadDilatedAttention(E, H, batch_first=True, segment_lengths=[4], dilation_rates=[1])
    x = torch.randn(2, 8, E)
    with pytest.raises(ValueError, match="same sequence length"):
        m(x, torch.randn(2, 6, E), torch.randn(2, 6, E))
    for exc in (ValueError, AssertionError, MultiheadAttentionError):
        with pytest.raises(exc, match=r"Expected key_padded_mask.shape\[1\] to be 8, but got 7"):
            m(x, x, x, key_padding_mask=torch.zeros(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="only bool and floating types of key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="The shape of the 2D attn_mask is"):
        m(x, x, x, attn_mask=torch.zeros(8, 7))
    with pytest.raises(ValueError, match="query should be unbatched 2D or batched 3D tensor"):
        m(x[None], x[None], x[None])
    with pytest.raises(ValueError, match="was expecting embedding dimension of 16, but got 17"):
        m(torch.randn(2, 8, E + 1), x, x)
    with pytest.raises(ValueError, match=r"key shape .* does not match value shape"):
        m(x, x, torch.randn(2, 9, E))


# ---------------------------------------------------------------------------
# group=: sequence-sharded module in real gloo processes.

SHARD_CASES = [
    # (pattern kwargs, batch_first, is_causal, head_groups)
    ({}, True, False, False),
    ({}, False, True, False),
    ({"segment_lengths": [4, 8], "dilation_rates": [1, 2]}, True, False, False),
    ({"segment_lengths": [3, 6], "dilation_rates": [1, 2]}, False, True, True),
]


def _sharded_worker(rank: int, world: int, n: int) -> list[str]:
    import torch.distributed as dist

    from ring_attention.parallel.exchange_plan import PLAN_CACHE
    from ring_attention.parallel.sharding import gather_sequence, shard_sequence

    group = dist.group.WORLD
    problems: list[str] = []
    for idx, (pat, bf, causal, hg) in enumerate(SHARD_CASES):
        torch.manual_seed(100 + idx)
        kw = dict(batch_first=bf, dtype=torch.float64, head_groups=hg, **pat)
        full = MultiheadDilatedAttention(E, H, **kw)
        sharded = MultiheadDilatedAttention(E, H, group=group, **kw)
        sharded.load_state_dict(full.state_dict())
        B = 2
        x = (
            torch.randn(B, n, E, dtype=torch.float64)
            if bf
            else torch.randn(n, B, E, dtype=torch.float64)
        )
        seq_dim = 1 if bf else 0
        am = (
            nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)
            if causal
            else None
        )
        x_full = x.clone().requires_grad_(True)
        ref, _ = full(x_full, x_full, x_full, need_weights=False, attn_mask=am, is_causal=causal)
        g = torch.randn_like(ref)  # same on every rank (same seed)
        (ref * g).sum().backward()

        x_loc = shard_sequence(x, dim=seq_dim, group=group).clone().requires_grad_(True)
        out, w = sharded(x_loc, x_loc, x_loc, need_weights=False, attn_mask=am, is_causal=causal)
        want = shard_sequence(ref.detach(), dim=seq_dim, group=group)
        err = (out - want).abs().max().item()
        if w is not None or out.shape != want.shape or err > 1e-10:
            problems.append(f"case {idx}: forward error {err}, shape {tuple(out.shape)}")
        (out * shard_sequence(g, dim=seq_dim, group=group)).sum().backward()
        gx = (x_loc.grad - shard_sequence(x_full.grad, dim=seq_dim, group=group)).abs().max().item()
        if gx > 1e-10:
            problems.append(f"case {idx}: input grad error {gx}")
        for (name, p_full), p_sh in zip(full.named_parameters(), sharded.parameters(), strict=True):
            gp = p_sh.grad.clone()
            dist.all_reduce(gp, group=group)  # each rank holds its shard's share
            e = (gp - p_full.grad).abs().max().item()
            if e > 1e-10:
                problems.append(f"case {idx}: grad of {name} error {e}")

    # Cloning (nn.TransformerEncoder deep-copies its layer) shares the group.
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    layer.self_attn = MultiheadDilatedAttention(E, H, batch_first=True, group=group)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    if any(lyr.self_attn.group is not group for lyr in enc.layers):
        problems.append("deepcopy did not share the process group")
    enc.layers[1].self_attn.in_proj_weight.data.add_(1.0)
    if torch.equal(enc.layers[0].self_attn.in_proj_weight, enc.layers[1].self_attn.in_proj_weight):
        problems.append("deepcopy shared the parameters")
    xs = shard_sequence(torch.randn(2, n, E), dim=1, group=group)
    full_enc = copy.deepcopy(enc)
    for lyr in full_enc.layers:
        lyr.self_attn.group = None
    got = enc(xs)
    want = shard_sequence(full_enc(gather_sequence(xs, dim=1, group=group)), dim=1, group=group)
    if (got - want).abs().max() > 1e-5:
        problems.append("TransformerEncoder with a sharded self_attn differs")

    # A repeated call builds no new exchange plan.
    sharded = MultiheadDilatedAttention(E, H, batch_first=True, dtype=torch.float64, group=group,
                                        segment_lengths=[4, 8], dilation_rates=[1, 2])  # fmt: skip
    with torch.no_grad():
        before = PLAN_CACHE.info()
        x = shard_sequence(torch.randn(1, n, E, dtype=torch.float64), dim=1, group=group)
        sharded(x, x, x, need_weights=False)
        mid = PLAN_CACHE.info()
        sharded(x, x, x, need_weights=False)
        after = PLAN_CACHE.info()
    if not (after["misses"] == mid["misses"] and after["hits"] == mid["hits"] + 1):
        problems.append(f"plan cache: before {before}, after first {mid}, after second {after}")

    # Unsupported combinations raise ValueError naming the argument, before
    # any communication (every rank raises the same error).
    m = MultiheadDilatedAttention(E, H, batch_first=True, group=group, dropout=0.1)
    x = torch.randn(1, 5, E)
    checks = [
        ("need_weights", dict(need_weights=True)),
        ("attn_mask", dict(need_weights=False, attn_mask=torch.zeros(5, 5))),
        ("key_padding_mask", dict(need_weights=False,
                                  key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))),
        ("dropout", dict(need_weights=False)),
    ]  # fmt: skip
    for name, kwargs in checks:
        try:
            m(x, x, x, **kwargs)
            problems.append(f"{name}: no error")
        except ValueError as e:
            if name not in str(e):
                problems.append(f"{name}: message {e}")
    m.eval()
    try:
        m(x, torch.randn(1, 4, E), torch.randn(1, 4, E), need_weights=False)
        problems.append("cross-attention: no error")
    except ValueError as e:
        if "key" not in str(e):
            problems.append(f"cross-attention: message {e}")
    nested = torch.nested.nested_tensor([torch.randn(5, E), torch.randn(3, E)])
    with torch.no_grad():  # the fused path's conditions: a plain module would take it
        try:
            m(nested, nested, nested, need_weights=False)
            problems.append("nested: no error")
        except ValueError as e:
            if "nested" not in str(e):
                problems.append(f"nested: message {e}")
    try:
        MultiheadDilatedAttention(E, H, group=group, add_bias_kv=True)
        problems.append("add_bias_kv: no error")
    except ValueError as e:
        if "add_bias_kv" not in str(e):
            problems.append(f"add_bias_kv: message {e}")
    return problems


@pytest.mark.parametrize("world,n", [(2, 13), (3, 17)])
def test_sharded_module_equals_unsharded(world, n) -> None:
    results = run_distributed(_sharded_worker, world, n, timeout=300)
    assert results == [[]] * world, results


# ---------------------------------------------------------------------------
# Packed documents (keyword-only cu_seqlens).


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("pattern", [None, ([4, 8], [1, 2])])
def test_packed_documents_equal_separate_calls(need_weights, pattern) -> None:
    """A packed sequence with cu_seqlens gives, on each document, what the
    document alone gives (kernel path without weights, dense path with)."""
    torch.manual_seed(0)
    kw = {} if pattern is None else {"segment_lengths": pattern[0], "dilation_rates": pattern[1]}
    m = ra.MultiheadDilatedAttention(16, 4, batch_first=True, **kw).eval()
    cu = [0, 5, 5, 6, 17, 30]
    x = torch.randn(2, 30, 16)
    out, w = m(x, x, x, need_weights=need_weights, cu_seqlens=torch.tensor(cu))
    for a, b in itertools.pairwise(cu):
        if a == b:
            continue
        xs = x[:, a:b]
        ref, wr = m(xs, xs, xs, need_weights=need_weights, cu_seqlens=[0, b - a])
        torch.testing.assert_close(out[:, a:b], ref, atol=1e-5, rtol=1e-5)
        if need_weights:
            torch.testing.assert_close(w[:, a:b, a:b], wr, atol=1e-6, rtol=1e-5)
            assert not w[:, a:b, :a].any() and not w[:, a:b, b:].any()


def test_packed_documents_need_self_attention_lengths() -> None:
    m = ra.MultiheadDilatedAttention(16, 4, batch_first=True)
    x, y = torch.randn(1, 10, 16), torch.randn(1, 12, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, y, y, need_weights=False, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, x, x, need_weights=False, cu_seqlens=[0, 4, 9])
