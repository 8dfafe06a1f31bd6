"""torch.compile of the ring and of the transformers backend.

The ring is two custom operators (``torch.ops.ring_attention.ring_forward``
/ ``ring_backward``) that the compiler keeps opaque; the configuration of a
call is decided once, while tracing. These tests compile with
``fullgraph=True`` (a graph break is an error), count the compiled frames
over several steps (no recompilation for fixed shapes; with ``dynamic=True``
one per distinct pattern) and compare forward and backward with eager, in
real gloo processes. Ulysses and the hybrid, whose all-to-alls run eagerly,
compile with ``fullgraph=False`` (one break at the call) and refuse
``fullgraph=True`` saying so.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import ring_attention as ra
from ring_attention.core.pattern import Pattern
from ring_attention.parallel.ring import ring_call_spec
from ring_attention.parallel.testing import run_distributed

SEGS, DILS = [4, 8], [1, 2]
PATTERN = {"segment_lengths": [6, 16], "dilation_rates": [1, 3]}
N = 29  # shards of 15 and 14


def _config() -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0)  # fmt: skip
    cfg.dilated_attention = PATTERN
    return cfg


def _steps(fn, inputs, params, backend, steps=3):
    """Output and gradients of ``fn`` compiled with ``backend`` over ``steps``
    calls (the last), and the number of frames it compiled."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for step in range(steps):
        # a tuple of one value per step stands for a new tensor at every step
        out = compiled(*(t[step] if isinstance(t, tuple) else t for t in inputs))
        grads = torch.autograd.grad(out.sum(), params)
    return out.detach(), list(grads), counter.frame_count


def _eager(fn, inputs, params):
    out = fn(*inputs)
    return out.detach(), list(torch.autograd.grad(out.sum(), params))


def check_layer_compiles_whole(layer, x, mask, positions, rope, grad_tol: float) -> None:
    """A decoder ``layer`` compiled fullgraph (aot_eager) over three steps, each
    with a new mask tensor as every batch brings one: one frame, the output
    bitwise the eager one and the gradients (of x and the weights) within
    ``grad_tol``."""

    def decoder(x, mask):
        return layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)

    params = [x, *layer.parameters()]
    want = _eager(decoder, (x, mask), params)
    masks = (None,) * 3 if mask is None else (mask.clone(), mask.clone(), mask.clone())
    out, grads, frames = _steps(decoder, (x, masks), params, "aot_eager")
    assert frames == 1
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)
    for a, b in zip(grads, want[1], strict=True):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


def _max_error(got, want) -> float:
    (out, grads), (want_out, want_grads) = got, want
    pairs = zip([out, *grads], [want_out, *want_grads], strict=True)
    return float(max((a - b).abs().max() for a, b in pairs))


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    found: dict = {}

    # The ring call: GQA, causal, documents given as a tensor, an explicit group.
    q, k, v = (torch.randn(2, N, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 20, N])
    q, k, v = (ra.shard_sequence(t, 1).detach().requires_grad_() for t in (q, k, v))

    def ring(q, k, v, cu):
        return ra.ring_dilated_attention(q, k, v, SEGS, DILS, causal=True, cu_seqlens=cu,
                                         group=dist.group.WORLD)  # fmt: skip

    want = _eager(ring, (q, k, v, cu), (q, k, v))
    for backend in ("eager", "aot_eager", "inductor"):
        out, grads, frames = _steps(ring, (q, k, v, cu), (q, k, v), backend)
        found[f"ring {backend}"] = (frames, _max_error((out, grads), want))

    # One decoder layer of a transformers model, sequence parallel.
    ra.register_transformers(group=dist.group.WORLD)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="ring_dilated")
    layer = model.double().model.layers[0]
    x = ra.shard_sequence(torch.randn(2, N, 64, dtype=torch.float64), 1).requires_grad_()
    positions = ra.shard_sequence(torch.arange(N)[None], 1)
    rope = model.model.rotary_emb(x, positions)
    docs = torch.tensor([0, 11, N], dtype=torch.int32)

    def decoder(x, docs):
        return layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope,
                     cu_seq_lens_q=docs, cu_seq_lens_k=docs)  # fmt: skip

    params = [x, *layer.parameters()]
    want = _eager(decoder, (x, docs), params)
    out, grads, frames = _steps(decoder, (x, docs), params, "aot_eager")
    found["decoder aot_eager"] = (frames, _max_error((out, grads), want))

    # A call one rank refuses raises on every rank, from inside the compiled graph.
    bad = torch.tensor([0, 20, 5, N]) if rank == 0 else cu
    try:
        torch.compile(ring, backend="aot_eager", fullgraph=True)(q, k, v, bad)
        found["refused"] = "no error"
    except ValueError as exc:
        found["refused"] = str(exc)
    ra.register_transformers()
    return found


def test_ring_and_decoder_layer_compile_fullgraph_on_two_ranks() -> None:
    for rank, found in enumerate(run_distributed(_worker, 2, timeout=600)):
        for name in ("ring eager", "ring aot_eager", "ring inductor", "decoder aot_eager"):
            frames, err = found[name]
            assert frames == 1, (rank, name, frames)  # one graph, no recompilation
            assert err == 0.0, (rank, name, err)  # the same operators as eager, in order
        if rank == 0:
            assert "non-decreasing" in found["refused"], found["refused"]
        else:
            refused = found["refused"]
            assert "rank 0 failed:" in refused and "non-decreasing" in refused, refused


def _compiled_steps(fn, calls, params, **options):
    """``fn`` compiled (aot_eager) over ``calls`` (argument tuples) against
    eager, forward and backward: the largest error, and the frames compiled."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, **options)
    error = 0.0
    for args in calls:
        got = _eager(lambda *a: compiled(*a), args, params)
        error = max(error, _max_error(got, _eager(fn, args, params)))
    return error, counter.frame_count


def _compile_error(fn, args) -> str:
    """What ``torch.compile(fn, fullgraph=True)(*args)`` raises."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    except torch._dynamo.exc.Unsupported as exc:
        return str(exc)
    return "no error"


def _modules_worker(rank: int, world: int) -> dict:
    """On 4 ranks: the ring modules under fullgraph=True; dynamic=True with
    the window and the segment lengths from arguments and from a closure;
    Ulysses (U = 4) and the 2 x 2 hybrid under fullgraph=False and True."""
    from ring_attention.parallel.ulysses_eager import REASON

    torch.manual_seed(0)
    found: dict = {}
    ring = dist.group.WORLD
    n = 31  # shards of 8, 8, 8, 7
    q, k, v = (torch.randn(2, n, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 9, 20, n])
    q, k, v = (ra.shard_sequence(t, 1).detach().requires_grad_() for t in (q, k, v))

    # RingDilatedAttention: a window, GQA, causal, documents as a tensor.
    module = ra.RingDilatedAttention(SEGS, DILS, causal=True, group=ring, window=(5, 0))
    found["RingDilatedAttention"] = _compiled_steps(
        lambda q, k, v, cu: module(q, k, v, cu), [(q, k, v, cu)] * 2, (q, k, v), fullgraph=True
    )

    # MultiheadDilatedAttention with group=, batch first.
    mha = ra.MultiheadDilatedAttention(
        32, 4, batch_first=True, segment_lengths=[4, 8], dilation_rates=[1, 2], group=ring,
        dtype=torch.float64,
    )  # fmt: skip
    x = ra.shard_sequence(torch.randn(2, n, 32, dtype=torch.float64), 1).requires_grad_()
    found["MultiheadDilatedAttention"] = _compiled_steps(
        lambda x: mha(x, x, x, need_weights=False)[0], [(x,)] * 2, [x, *mha.parameters()],
        fullgraph=True,
    )  # fmt: skip

    # dynamic=True: the window and the segment lengths of an argument, then
    # of a closure; another value recompiles (the graph guards on them).
    def by_argument(q, k, v, segments, window):
        return ra.ring_dilated_attention(q, k, v, segments, DILS, window=window, group=ring)

    values = [([4, 8], (3, 0)), ([6, 12], (2, 2)), ([4, 8], (3, 0)), ([6, 12], [-1, 1])]
    found["dynamic argument"] = _compiled_steps(
        by_argument, [(q, k, v, s, w) for s, w in values], (q, k, v), fullgraph=True,
        dynamic=True,
    )  # fmt: skip

    def closure(segments, window):
        def by_closure(q, k, v):
            return ra.ring_dilated_attention(q, k, v, segments, DILS, window=window, group=ring)

        return by_closure

    found["dynamic closure"] = [
        _compiled_steps(closure(*value), [(q, k, v)], (q, k, v), fullgraph=True, dynamic=True)
        for value in values[:2]
    ]

    # Ulysses over the 4 ranks and the 2 x 2 hybrid: one graph break at the
    # call (the code before and after it compiles), or Dynamo's error.
    i, j = divmod(rank, 2)
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    for name, kw in (("Ulysses", dict(group=None, ulysses_group=ring)),
                     ("hybrid", dict(group=cols[j], ulysses_group=rows[i]))):  # fmt: skip
        full = [torch.randn(2, n, h, 8, dtype=torch.float64) for h in (4, 2, 2)]
        qs, ks, vs = (ra.shard_sequence(t, 1, **kw).requires_grad_() for t in full)

        def spread(q, k, v, kw=kw):
            out = ra.ring_dilated_attention(q * 2, k, v, SEGS, DILS, causal=True, window=(6, 0),
                                            **kw)  # fmt: skip
            return out + 1

        found[name] = _compiled_steps(spread, [(qs, ks, vs)] * 2, (qs, ks, vs))
        found[f"{name} fullgraph"] = _compile_error(spread, (qs, ks, vs))
    found["reason"] = REASON
    return found


def test_ring_modules_dynamic_values_and_ulysses_compile_on_four_ranks() -> None:
    """``torch.compile(RingDilatedAttention(...))`` and of a sharded
    ``MultiheadDilatedAttention`` (a closure in the ring's call spec used to
    raise ClosureConversionError, even with fullgraph=False), ``dynamic=True``
    with the window and segment lengths from an argument or a closure (used to
    raise "assume_constant_result argument conversion failed"), equal to eager
    forward and backward; Ulysses and the hybrid break the graph once at the
    call, or refuse fullgraph=True saying that the all-to-alls run eagerly
    (used to fail inside: "lock context manager")."""
    for rank, found in enumerate(run_distributed(_modules_worker, 4, timeout=600)):
        for name in ("RingDilatedAttention", "MultiheadDilatedAttention"):
            err, frames = found[name]
            assert (err, frames) == (0.0, 1), (rank, name, err, frames)
        err, frames = found["dynamic argument"]
        # one graph per distinct (segments, window), none for a value seen before
        assert err == 0.0 and frames == 3, (rank, err, frames)
        assert found["dynamic closure"] == [(0.0, 1), (0.0, 1)], (rank, found["dynamic closure"])
        for name in ("Ulysses", "hybrid"):
            err, frames = found[name]
            assert (err, frames) == (0.0, 2), (rank, name, err, frames)
            assert found["reason"] in found[f"{name} fullgraph"], found[f"{name} fullgraph"]
            assert "run their all-to-alls eagerly" in found["reason"]


@pytest.mark.parametrize("padding", [False, True])
def test_decoder_layer_compiles_fullgraph_in_one_process(padding: bool) -> None:
    """The layer with the mask the model hands it (transformers' mask
    preparation runs once per forward, eagerly): none, or right padding."""
    from transformers.masking_utils import create_causal_mask

    ra.register_transformers()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="ring_dilated")
    layer = model.double().model.layers[0]
    x = torch.randn(2, N, 64, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(N)[None]
    rope = model.model.rotary_emb(x, positions)
    pad = torch.ones(2, N, dtype=torch.long)
    pad[1, N - 7 :] = 0
    mask = create_causal_mask(model.config, x, pad if padding else None, None,
                              position_ids=positions)  # fmt: skip
    assert (mask is None) != padding
    check_layer_compiles_whole(layer, x, mask, positions, rope, grad_tol=1e-12)


@pytest.mark.parametrize("documents", [False, True])
def test_ring_operators_opcheck(documents: bool) -> None:
    """The operators' schemas, fake kernels and traced forms (one process)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 13, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 6, 13]) if documents else None
    spec = ring_call_spec(Pattern, SEGS, DILS, True)  # causal
    ops = torch.ops.ring_attention
    torch.library.opcheck(ops.ring_forward, (q, k, v, cu, spec, False))
    out, lse, seq_len = ops.ring_forward(q, k, v, cu, spec, False)
    want, want_lse = ra.dilated_attention(q, k, v, SEGS, DILS, causal=True, cu_seqlens=cu,
                                          return_lse=True)  # fmt: skip
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    assert int(seq_len) == 13
    grad = torch.randn_like(out)
    torch.library.opcheck(ops.ring_backward, (grad, None, q, k, v, out, lse, cu, seq_len, spec))
