"""torch.compile and torch.export of models that use the local op.

``fullgraph=True`` makes any graph break an error, so these tests show that
``ra.dilated_attention`` (Python checks + the C++ op with its autograd (ops.py) and
Meta kernel), ``DilatedAttention`` and ``MultiheadDilatedAttention`` trace as
one graph, and that the compiled / exported programs match eager, forward and
backward.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

import ring_attention as ra
from ring_attention.nn.modules import DilatedAttention
from ring_attention.nn.multihead import MultiheadDilatedAttention

SEGS, DILS = [4, 8], [1, 2]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TinyNet(nn.Module):
    """Projection -> DilatedAttention -> projection, (B, N, C) in and out."""

    def __init__(self, channels: int = 16, heads: int = 4, causal: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(channels, 3 * channels)
        self.att = DilatedAttention(SEGS, DILS, causal=causal)
        self.out = nn.Linear(channels, channels)

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.inp(x).view(B, N, 3, self.heads, C // self.heads).unbind(2)
        y = self.att(q, k, v, key_padding_mask)
        return self.out(y.reshape(B, N, C))


def fwd_bwd(fn, *inputs):
    """Output and input gradients of sum(fn(*inputs) * weights)."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    w = torch.linspace(-1, 1, out.numel()).view_as(out)
    grads = torch.autograd.grad((out * w).sum(), [t for t in inputs if t.requires_grad])
    return out.detach(), grads


def assert_same(a, b, tol=1e-6):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, atol=tol, rtol=0)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, atol=tol, rtol=0)


def qkv_inputs(n: int = 19, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, 4, 8, generator=g) for _ in range(3))
    kpm = torch.rand(2, n, generator=g) < 0.2
    return q, k, v, kpm


def op_fn(q, k, v, kpm):
    return ra.dilated_attention(q, k, v, SEGS, DILS, causal=True, key_padding_mask=kpm)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_functional_fullgraph(backend) -> None:
    inputs = qkv_inputs()
    compiled = torch.compile(op_fn, backend=backend, fullgraph=True)
    assert_same(fwd_bwd(compiled, *inputs), fwd_bwd(op_fn, *inputs))


def test_functional_has_no_graph_break() -> None:
    explained = torch._dynamo.explain(op_fn)(*qkv_inputs())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.ring_attention.dilated_attention.default in ops or any(
        "ring_attention" in str(t) for t in ops
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("causal", [False, True])
def test_compile_module_fullgraph(backend, causal) -> None:
    torch.manual_seed(0)
    net = TinyNet(causal=causal)
    x = torch.randn(2, 21, 16)
    kpm = torch.rand(2, 21) < 0.2
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    eager = fwd_bwd(net, x, kpm)
    net.zero_grad()
    got = fwd_bwd(compiled, x, kpm)
    assert_same(got, eager)


def test_compile_module_inductor() -> None:
    """Inductor around the op (an extern kernel call, forward and backward)."""
    mod = DilatedAttention(SEGS, DILS, causal=True)
    q, k, v, kpm = qkv_inputs(seed=1)
    compiled = torch.compile(mod, backend="inductor", fullgraph=True)
    assert_same(fwd_bwd(compiled, q, k, v, kpm), fwd_bwd(mod, q, k, v, kpm))


def test_compile_parameter_gradients_match() -> None:
    torch.manual_seed(0)
    net = TinyNet()
    x = torch.randn(2, 17, 16)
    net(x).square().sum().backward()
    eager = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch.compile(net, backend="aot_eager", fullgraph=True)(x).square().sum().backward()
    for a, b in zip(eager, (p.grad for p in net.parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("need_weights", [False, True])
def test_compile_multihead_fullgraph(need_weights) -> None:
    """MultiheadDilatedAttention: the op path and the dense (weights) path."""
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(16, 4, batch_first=True, segment_lengths=SEGS,
                                  dilation_rates=DILS)  # fmt: skip
    x = torch.randn(2, 19, 16)
    kpm = torch.rand(2, 19) < 0.2

    def f(x, kpm):
        out, w = m(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        return out if w is None else out + w.sum(-1, keepdim=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_same(fwd_bwd(compiled, x, kpm), fwd_bwd(f, x, kpm))


def test_compile_dynamic_lengths_compile_once() -> None:
    """dynamic=True: one graph serves every sequence length (the Meta kernels
    work on symbolic sizes) and each length is exact."""
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(op_fn, backend=counter, fullgraph=True, dynamic=True)
    for n in (9, 19, 24):
        inputs = qkv_inputs(n)
        torch.testing.assert_close(compiled(*inputs), op_fn(*inputs), atol=0, rtol=0)
    assert counter.frame_count == 1


def test_export_dynamic_sequence_length() -> None:
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, kpm):
            return op_fn(q, k, v, kpm)

    seq = torch.export.Dim("seq", min=2, max=4096)
    ep = torch.export.export(
        Attend(), qkv_inputs(19), dynamic_shapes=({1: seq}, {1: seq}, {1: seq}, {1: seq})
    )
    for n in (5, 33):
        inputs = qkv_inputs(n)
        torch.testing.assert_close(ep.module()(*inputs), op_fn(*inputs), atol=0, rtol=0)


def test_export_module() -> None:
    torch.manual_seed(0)
    net = TinyNet(causal=True).eval()
    x = torch.randn(2, 21, 16)
    kpm = torch.rand(2, 21) < 0.2
    ep = torch.export.export(net, (x, kpm))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.ring_attention.dilated_attention.default in targets
    torch.testing.assert_close(ep.module()(x, kpm), net(x, kpm), atol=0, rtol=0)
    x2 = torch.randn(2, 21, 16)  # other values, same shapes
    torch.testing.assert_close(ep.module()(x2, kpm), net(x2, kpm), atol=0, rtol=0)
    # The exported program is differentiable too.
    assert_same(fwd_bwd(ep.module(), x, kpm), fwd_bwd(net, x, kpm))


def test_export_multihead_module() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(16, 4, batch_first=True, segment_lengths=SEGS,
                                  dilation_rates=DILS).eval()  # fmt: skip
    x = torch.randn(2, 19, 16)
    ep = torch.export.export(m, (x, x, x), kwargs={"need_weights": False})
    out, w = ep.module()(x, x, x, need_weights=False)
    ref, _ = m(x, x, x, need_weights=False)
    assert w is None
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def _heads_first_fn(q, k, v):
    """q, k, v stored (B, H, N, D) and passed as (B, N, H, D) views; the
    output is viewed as (B, N, H * D), which needs it contiguous."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = ra.dilated_attention(qt, kt, vt, SEGS, DILS, causal=True)
    return out.view(out.shape[0], out.shape[1], -1)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_non_contiguous_inputs(backend) -> None:
    """The Meta kernels give contiguous outputs and gradients, as the real
    kernels do, so a compiled graph with non-contiguous inputs agrees with
    eager about strides (a view of the output compiles)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 19, 8, generator=g) for _ in range(3))
    compiled = torch.compile(_heads_first_fn, backend=backend, fullgraph=True)
    assert_same(fwd_bwd(compiled, q, k, v), fwd_bwd(_heads_first_fn, q, k, v))


# ------------------------------------------------------------ packed documents

DOCS = [0, 5, 5, 12, 19]


def docs_fn(q, k, v, kpm):
    return ra.dilated_attention(q, k, v, SEGS, DILS, causal=True, cu_seqlens=DOCS)


def docs_tensor_fn(q, k, v, cu):
    return ra.dilated_attention(q, k, v, SEGS, DILS, causal=True, cu_seqlens=cu)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_constant_documents_fullgraph(backend) -> None:
    """A constant cu_seqlens list is checked in plain Python while tracing
    (no data-dependent guard) and becomes a constant of the graph."""
    inputs = qkv_inputs()
    compiled = torch.compile(docs_fn, backend=backend, fullgraph=True)
    got = fwd_bwd(compiled, *inputs)
    assert_same(got, fwd_bwd(docs_fn, *inputs))
    # The documents matter: the same call without them differs.
    plain = ra.dilated_attention(*inputs[:3], SEGS, DILS, causal=True)
    assert not torch.allclose(got[0], plain)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_documents_tensor_fullgraph(backend) -> None:
    """A cu_seqlens tensor input: its values do not exist while tracing, the
    operator checks them when it runs; one graph serves other boundaries (as
    many of them: another count is another shape)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(docs_tensor_fn, backend=counter, fullgraph=True)
    q, k, v, _ = qkv_inputs()
    for docs in (DOCS, [0, 1, 2, 3, 19], [0, 19, 19, 19, 19]):
        cu = torch.tensor(docs, dtype=torch.int32)
        assert_same(fwd_bwd(compiled, q, k, v, cu), fwd_bwd(docs_tensor_fn, q, k, v, cu))
    assert counter.frame_count == 1
    with pytest.raises(RuntimeError, match="cu_seqlens must end at the sequence length 19"):
        compiled(q, k, v, torch.tensor([0, 5, 6, 7, 18], dtype=torch.int32))


def test_export_documents_tensor() -> None:
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, cu):
            return docs_tensor_fn(q, k, v, cu)

    q, k, v, _ = qkv_inputs()
    cu = torch.tensor(DOCS, dtype=torch.int64)
    bounds = torch.export.Dim("bounds", min=2, max=4096)  # any number of documents
    shapes = (None, None, None, {0: bounds})
    ep = torch.export.export(Attend(), (q, k, v, cu), dynamic_shapes=shapes)
    for docs in (DOCS, [0, 3, 19], [0, 19]):
        cu = torch.tensor(docs, dtype=torch.int64)
        torch.testing.assert_close(
            ep.module()(q, k, v, cu), docs_tensor_fn(q, k, v, cu), atol=0, rtol=0
        )
    assert_same(fwd_bwd(ep.module(), q, k, v, cu), fwd_bwd(docs_tensor_fn, q, k, v, cu))


def test_export_constant_documents() -> None:
    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return docs_fn(q, k, v, None)

    q, k, v, _ = qkv_inputs()
    ep = torch.export.export(Attend(), (q, k, v))
    torch.testing.assert_close(ep.module()(q, k, v), docs_fn(q, k, v, None), atol=0, rtol=0)


def test_compile_module_documents_tensor() -> None:
    mod = DilatedAttention(SEGS, DILS, causal=True)
    q, k, v, kpm = qkv_inputs(seed=2)
    cu = torch.tensor(DOCS)
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    assert_same(fwd_bwd(compiled, q, k, v, kpm, cu), fwd_bwd(mod, q, k, v, kpm, cu))
