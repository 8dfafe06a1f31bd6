"""The dispatch guard against hidden copies (ring_attention/local/dispatch.py's
``aligned``): a view a dense CUDA backend would copy (its start not 16-byte
aligned, or a stride not a multiple of 8 elements; flash-attn-4 copies such
tensors silently) takes our kernel, on the local op's route and on the
ring's dense blocks. Run on the CPU with fake CUDA tensors (FakeTensorMode:
meta storage, ``device=cuda``) and the route of a compute capability 9.0
device; the CPU stand-in backend copies its results anyway, so the guard is
CUDA's only."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ring_attention.core import config
from ring_attention.core.call import Call
from ring_attention.core.pattern import Pattern
from ring_attention.local import backends, blocks, dispatch
from ring_attention.local.block_calls import block_calls

BF16 = torch.bfloat16
SHAPE = (1, 4096, 4, 64)


def _at(shape, offset=0, pad=0, dtype=BF16, device="cuda"):
    """A ``(B, n, H, d)`` view ``offset`` elements into a storage whose
    rows are ``d + pad`` elements apart."""
    b, n, h, d = shape
    base = torch.empty(b * n * h * (d + pad) + offset, dtype=dtype, device=device)
    return base.as_strided(shape, (n * h * (d + pad), h * (d + pad), d + pad, 1), offset)


@pytest.fixture
def sm90(monkeypatch):
    """Dense forced, the capability of an sm_90 device, fake CUDA tensors."""
    monkeypatch.setenv(config.FORWARD, "dense")
    monkeypatch.setenv(config.BACKWARD, "dense")
    monkeypatch.setattr(dispatch, "_capability", lambda d: (9, 0) if d.type == "cuda" else (0, 0))
    with FakeTensorMode():
        yield


def test_aligned() -> None:
    assert backends.aligned(_at(SHAPE, device="cpu"))
    assert backends.aligned(_at(SHAPE, offset=8, device="cpu"))  # 16 bytes in
    assert not backends.aligned(_at(SHAPE, offset=1, device="cpu"))  # 2 bytes in
    assert not backends.aligned(_at(SHAPE, offset=4, device="cpu"))  # 8 bytes in
    assert backends.aligned(_at(SHAPE, offset=4, dtype=torch.float32, device="cpu"))
    assert not backends.aligned(_at(SHAPE, pad=4, device="cpu"))  # head stride 68
    assert backends.aligned(_at(SHAPE, pad=8, device="cpu"))  # head stride 72
    # a dimension of one has no stride that matters
    one = torch.empty(1, 8, 1, 16, dtype=BF16).as_strided((1, 8, 1, 16), (3, 16, 5, 1))
    assert backends.aligned(one)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("how", ["offset", "stride"])
def test_misaligned_views_take_the_kernel(which, how, sm90) -> None:
    pattern = Pattern([1024, 2048, 4096], [1, 2, 4])
    good = {name: _at(SHAPE) for name in "qkv"}
    for pass_ in ("forward", "backward"):
        r = dispatch.route(pass_, *good.values(), pattern, None)
        assert r.dense, r.why
    bad = dict(good)
    bad[which] = _at(SHAPE, offset=1) if how == "offset" else _at(SHAPE, pad=4)
    for pass_ in ("forward", "backward"):
        r = dispatch.route(pass_, *bad.values(), pattern, None)
        assert not r.dense and r.why == dispatch.MISALIGNED
    # aligned once more: 16 bytes in, head stride 72
    ok = dict(good)
    ok[which] = _at(SHAPE, offset=8) if how == "offset" else _at(SHAPE, pad=8)
    assert dispatch.route("forward", *ok.values(), pattern, None).dense


def test_the_cpu_stand_in_takes_misaligned_views(monkeypatch) -> None:
    monkeypatch.setenv(config.FORWARD, "dense")
    q, k, v = (_at((1, 64, 2, 8), offset=1, device="cpu") for _ in range(3))
    assert dispatch.route("forward", q, k, v, Pattern([16, 32], [1, 2]), None).dense


class _Recorder:
    name = "flash"

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, *_args) -> None:
        self.calls += 1

    def backward(self, *_args) -> None:
        self.calls += 1


@pytest.mark.parametrize("segments", [([2 * SHAPE[1]], [1]), ([1000, 3000], [1, 2])],
                         ids=["dense", "dilated"])  # fmt: skip
@pytest.mark.parametrize("which", ["q", "k", "v", "go", "out"])
def test_misaligned_ring_blocks_take_the_block_kernel(which, segments, sm90, monkeypatch) -> None:
    """A plain dense block, or a dilated one whose segments cross the pieces, whose piece is
    misaligned (as one unpacked from a transfer buffer may be): the dense route declines it (the
    block kernel runs it) before any call; aligned, the backend runs its calls (one, or one per
    branch, offset class and segment cut by the pieces: their views and parts aligned)."""
    monkeypatch.setattr(blocks, "KvFinite", lambda k, v: True)  # no device to ask
    monkeypatch.setattr(blocks, "merge_into", lambda *_a: None)  # no device to merge on
    monkeypatch.setattr(  # nor to copy on
        blocks, "_final_lse", lambda c, lse, q: blocks._part(c.q, q, None, lse.dtype)
    )
    n = SHAPE[1]
    call = Call(Pattern(*segments), 64**-0.5)
    calls = len(block_calls(call.pattern, 4, 4, n, n, 0, n))
    # dilated: one segment of each branch meets both pieces; branch 1's two offsets
    assert calls == (1 if len(segments[0]) == 1 else 3)
    t = {name: _at(SHAPE) for name in ("q", "k", "v", "go", "out")}
    out_acc = torch.zeros(SHAPE, dtype=torch.float32, device="cuda")
    lse = torch.zeros(1, 4, n, dtype=torch.float32, device="cuda")
    grads = [torch.zeros(SHAPE, dtype=torch.float32, device="cuda") for _ in range(3)]
    for pass_ in ("forward", "backward"):
        blk = blocks.ring_blocks(call, pass_, t["q"], t["k"], 2 * n, (0, n, 2 * n), n)
        assert blk.dense is not None and blk.backend is not None, pass_
        blk.backend = rec = _Recorder()

        def run(x, blk=blk, pass_=pass_):
            if pass_ == "forward":
                return blk._dense_forward(x["q"], x["k"], x["v"], out_acc, lse, n, 0)
            return blk._dense_backward(x["go"], x["q"], x["k"], x["v"], x["out"], lse, *grads,
                                       n, 0)  # fmt: skip

        assert run(t) and rec.calls == calls
        if pass_ == "forward" and which in ("go", "out"):
            continue  # the forward reads neither
        bad = dict(t, **{which: _at(SHAPE, offset=1)})
        assert not run(bad) and rec.calls == calls


@pytest.mark.parametrize(
    "n,heads,kv_heads,kw",
    [
        (1000, 6, 6, {}),
        (1000, 8, 2, {"causal": True}),
        (1000, 6, 3, {"head_offsets": "grouped", "causal": True}),
        (1000, 6, 6, {"documents": [0, 300, 301, 700, 1000]}),
    ],
    ids=["longnet", "gqa-causal", "grouped-offsets", "documents"],
)
@pytest.mark.parametrize("batch", [1, 2])
def test_part_views_are_aligned(n, heads, kv_heads, kw, batch, monkeypatch) -> None:
    """Every view a dense call gets (q, k, v, out, grad_out views and every
    part buffer view, outputs and LSE, forward and backward) starts 16-byte
    aligned and has strides that are multiples of 8 elements, whatever the
    calls' rows (ragged last segments, dilations 1 ... 6): the part buffers
    pad each head's rows to a multiple of 8 (before, a call's part rows
    started wherever the previous call's ended)."""
    from ring_attention.local import branches

    monkeypatch.setenv(config.FORWARD, "dense")
    monkeypatch.setenv(config.BACKWARD, "dense")
    monkeypatch.setenv(config.SPAN_ROWS, "1")
    docs = kw.pop("documents", None)
    pattern = Pattern([40, 80, 160], [1, 3, 6], **kw)
    if docs is not None:
        pattern = pattern.with_documents(docs)
    q, go = (torch.empty(batch, n, heads, 64, dtype=BF16) for _ in range(2))
    k, v = (torch.empty(batch, n, kv_heads, 64, dtype=BF16) for _ in range(2))
    out = torch.empty_like(q)
    fwd = dispatch.route("forward", q, k, v, pattern, None)
    bwd = dispatch.route("backward", q, k, v, pattern, None)
    assert fwd.dense and bwd.dense, (fwd.why, bwd.why)
    pf = branches._program("forward", fwd, q, k, v, out)
    pb = branches._program("backward", bwd, go, q, k, v, out)
    parts, lse = torch.empty(pf.q_rows, 64, dtype=BF16), torch.empty(pf.lse_rows)
    gq, gk, blse = (torch.empty(pb.q_rows, 64, dtype=BF16), torch.empty(pb.kv_rows, 64,
                    dtype=BF16), torch.empty(pb.q_rows))  # fmt: skip
    views = 0
    for *_, launches in pf.spans:
        for (_, into_out), qg, kg, vg, og, lg in launches:
            args = ((q, qg), (k, kg), (v, vg), (out if into_out else parts, og), (lse, lg))
            for t, g in args:
                assert backends.aligned(t.as_strided(*g)), g
                views += 1
    for *_, launches in pb.spans:
        for _, dog, qg, kg, vg, og, lg, gqg, gkg, gvg in launches:
            args = ((go, dog), (q, qg), (k, kg), (v, vg), (out, og), (blse, lg), (gq, gqg),
                    (gk, gkg), (gk, gvg))  # fmt: skip
            for t, g in args:
                assert backends.aligned(t.as_strided(*g)), g
                views += 1
    assert views > 100
