"""Outputs of every path of the package on fixed inputs, as digests: the local
op, the ring, Ulysses, the hybrid, cached decoding and the MHA module, forward
and backward. tests/test_reference_outputs.py compares them against
tests/data/reference_outputs.json, written by the commit before a change that
must keep them bit for bit (``python tests/reference_outputs.py --write``).

The CPU kernels' results depend on the instruction set and the BLAS path, so
the cases run pinned (:data:`PINNED`: our AVX2 kernels, PyTorch's AVX2
kernels, MKL's AVX2 code path, one thread): every x86-64 machine with AVX2
then computes the same bits.

A case's digest is the SHA-256 of each output's bytes, with its float64 sum
beside it so that a mismatch says how far off it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "reference_outputs.json"
#: The environment the cases run in (module docstring).
PINNED = {
    "RING_ATTENTION_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "OMP_NUM_THREADS": "1",
}

LONGNET = ([16, 32, 64], [1, 2, 4])


def digest(t: torch.Tensor | None) -> str:
    """``"sha256 float64-sum shape"`` of ``t`` (``"none"``: a missing gradient)."""
    if t is None:
        return "none"
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    shape = "x".join(map(str, t.shape))
    return f"{hashlib.sha256(raw).hexdigest()[:32]} {float(t.double().nansum())!r} {shape}"


def _inputs(seed: int, b: int, n: int, h: int, kv: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g).to(dtype)
    k = torch.randn(b, n, kv, d, generator=g).to(dtype)
    v = torch.randn(b, n, kv, d, generator=g).to(dtype)
    go = torch.randn(b, n, h, d, generator=g).to(dtype)
    gl = torch.randn(b, h, n, generator=g)
    return q, k, v, go, gl


def _fwd_bwd(fn, q, k, v, go, gl, lse: bool = True) -> dict[str, str]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    res = fn(q, k, v)
    out, l_ = res if isinstance(res, tuple) else (res, None)
    loss = (out.float() * go.float()).sum()
    if lse and l_ is not None:
        loss = loss + (l_.float().nan_to_num(0.0, 0.0, 0.0) * gl[:, : l_.shape[1]]).sum()
    loss.backward()
    got = {"out": digest(out), "dq": digest(q.grad), "dk": digest(k.grad), "dv": digest(v.grad)}
    if l_ is not None:
        got["lse"] = digest(l_)
    return got


LOCAL_CASES = {
    # name: (seed, batch, seq, heads, kv_heads, head_dim, dtype, keywords)
    "fp32_longnet": (1, 2, 300, 6, 2, 16, torch.float32, {}),
    "fp32_longnet_causal": (2, 1, 300, 6, 3, 16, torch.float32, {"causal": True}),
    "bf16_longnet_causal": (3, 1, 300, 6, 2, 16, torch.bfloat16, {"causal": True}),
    "fp64_documents": (
        4,
        1,
        200,
        4,
        2,
        8,
        torch.float64,
        {"causal": True, "cu_seqlens": [0, 70, 75, 200]},
    ),
    "fp32_window": (5, 1, 300, 4, 4, 16, torch.float32, {"causal": True, "window": (20, 0)}),
    "fp32_head_groups": (6, 1, 257, 6, 6, 16, torch.float32, {"head_groups": True}),
    "fp32_grouped_offsets": (7, 1, 257, 8, 4, 16, torch.float32, {"head_offsets": "grouped"}),
    "fp32_dense": (8, 2, 200, 4, 2, 32, torch.float32, {"causal": True, "pattern": ([200], [1])}),
    "fp32_padding": (9, 2, 150, 4, 2, 16, torch.float32, {"padding": True}),
}


def local_cases() -> dict[str, dict]:
    import ring_attention as ra

    got = {}
    for name, (seed, b, n, h, kv, d, dtype, kw) in LOCAL_CASES.items():
        kw = dict(kw)
        segs, dils = kw.pop("pattern", LONGNET)
        if kw.pop("padding", False):
            mask = torch.zeros(b, n, dtype=torch.bool)
            mask[0, -17:] = True
            mask[-1, :5] = True
            kw["key_padding_mask"] = mask
        q, k, v, go, gl = _inputs(seed, b, n, h, kv, d, dtype)

        def fn(q, k, v, segs=segs, dils=dils, kw=kw):
            return ra.dilated_attention(q, k, v, segs, dils, return_lse=True, **kw)

        got[name] = _fwd_bwd(fn, q, k, v, go, gl)
    return got


DIST_CASES = {
    # name: (world, ring, ulysses, seed, seq, heads, kv_heads, dtype, keywords)
    "ring3_longnet_causal": (
        3,
        3,
        1,
        11,
        301,
        6,
        2,
        torch.float32,
        {"causal": True, "cu_seqlens": [0, 90, 95, 301]},
    ),
    "ring3_window_zigzag": (
        3,
        3,
        1,
        12,
        300,
        4,
        2,
        torch.float32,
        {"causal": True, "window": (40, 0), "layout": "zigzag"},
    ),
    "ring2_dense_bf16": (
        2,
        2,
        1,
        13,
        256,
        4,
        4,
        torch.bfloat16,
        {"causal": True, "pattern": ([256], [1])},
    ),
    "ulysses2_longnet": (2, 1, 2, 14, 300, 6, 2, torch.float32, {"causal": True}),
    "ulysses2_offsets_mismatch": (
        2,
        1,
        2,
        15,
        256,
        6,
        6,
        torch.float32,
        {"pattern": ([32, 64], [2, 4])},
    ),
    "hybrid2x2_longnet": (4, 2, 2, 16, 301, 8, 4, torch.float32, {"causal": True}),
}


def _dist_worker(rank: int, world: int, ring: int, uly: int, seed: int, n: int, h: int, kv: int,
                 dtype: torch.dtype, kw: dict):  # fmt: skip
    import torch.distributed as dist

    import ring_attention as ra

    kw = dict(kw)
    segs, dils = kw.pop("pattern", LONGNET)
    layout = kw.pop("layout", "contiguous")
    q, k, v, go, _ = _inputs(seed, 1, n, h, kv, 16, dtype)
    if uly == 1:
        groups = {"group": None}
    elif ring == 1:
        groups = {"group": None, "ulysses_group": None}
    else:
        # ring i = rank // uly, Ulysses j = rank % uly
        rows = [dist.new_group([i * uly + j for j in range(uly)]) for i in range(ring)]
        cols = [dist.new_group([i * uly + j for i in range(ring)]) for j in range(uly)]
        groups = {"group": cols[rank % uly], "ulysses_group": rows[rank // uly]}
    shard_kw = {"layout": layout} if layout != "contiguous" else {}
    if "ulysses_group" in groups and groups["ulysses_group"] is None:
        groups["ulysses_group"] = dist.group.WORLD
    parts = [ra.shard_sequence(t, dim=1, **groups, **shard_kw) for t in (q, k, v, go)]
    ql, kl, vl = (p.clone().requires_grad_() for p in parts[:3])
    gol = parts[3]
    out, lse = ra.ring_dilated_attention(ql, kl, vl, segs, dils, return_lse=True, **groups,
                                         **shard_kw, **kw)  # fmt: skip
    (out.float() * gol.float()).sum().backward()
    gathered = {
        name: ra.gather_sequence(t.detach(), dim=1, **groups, **shard_kw)
        for name, t in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))
    }
    gathered["lse"] = ra.gather_sequence(lse.detach(), dim=2, **groups, **shard_kw)
    if rank != 0:
        return None
    got = {name: digest(t) for name, t in gathered.items()}
    got["oracle_error"] = repr(_oracle_error(q, k, v, go, segs, dils, kw, gathered))
    return got


def _oracle_error(q, k, v, go, segs, dils, kw, got) -> float:
    """The largest error of ``got`` against the float64 oracle, relative to
    each output's largest magnitude (not a digest: every run recomputes it)."""
    from oracle import reference_attention

    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(
        q, k, v, segs, dils, causal=kw.get("causal", False), cu_seqlens=kw.get("cu_seqlens"),
        window=kw.get("window"),
    )  # fmt: skip
    (out * go.double()).sum().backward()
    err = 0.0
    for name, want in (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad),
                       ("dv", v.grad)):  # fmt: skip
        want = want.detach()
        a, b = got[name].double(), want
        fin = torch.isfinite(b)
        err = max(err, float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30)))
    return err


def dist_cases() -> dict[str, dict]:
    from ring_attention.parallel.testing import run_distributed

    got = {}
    for name, (world, ring, uly, seed, n, h, kv, dtype, kw) in DIST_CASES.items():
        got[name] = run_distributed(_dist_worker, world, ring, uly, seed, n, h, kv, dtype, kw)[0]
    return got


def _tiny_llama(pattern: dict | None, kv_heads: int = 2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, pad_token_id=0)  # fmt: skip
    if pattern is not None:
        cfg.dilated_attention = pattern
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="ring_dilated").eval()


def decode_cases() -> dict[str, dict]:
    from transformers import StaticCache

    import ring_attention as ra

    ra.register_transformers()
    got = {}
    pattern = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4]}
    prompt = torch.randint(1, 61, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0  # left padding
    for name, pat, static in (("dynamic_dense", None, False), ("dynamic_pattern", pattern, False),
                              ("static_pattern", pattern, True)):  # fmt: skip
        model = _tiny_llama(pat)
        kw = {}
        if static:
            kw["past_key_values"] = StaticCache(config=model.config, max_cache_len=48)
        with torch.no_grad():
            res = model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=8,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **kw,
            )
        got[name] = {"tokens": digest(res.sequences), "logits": digest(torch.stack(res.logits))}
    return got


def mha_cases() -> dict[str, dict]:
    import ring_attention as ra

    got = {}
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, 120, 48, generator=g)
    for name, kw, need_weights in (
        ("pattern", {"segment_lengths": [16, 32], "dilation_rates": [1, 2]}, False),
        ("pattern_weights", {"segment_lengths": [16, 32], "dilation_rates": [1, 2]}, True),
        ("dense", {}, False),
    ):
        torch.manual_seed(0)
        mha = ra.MultiheadDilatedAttention(48, 6, batch_first=True, **kw)
        xi = x.clone().requires_grad_()
        out, w = mha(xi, xi, xi, need_weights=need_weights, is_causal=False)
        out.square().sum().backward()
        got[name] = {"out": digest(out), "weights": digest(w), "dx": digest(xi.grad),
                     "dw": digest(mha.in_proj_weight.grad)}  # fmt: skip
    return got


def compute() -> dict[str, dict]:
    """Every case's digests (run under :data:`PINNED`)."""
    torch.set_num_threads(1)
    return {"local": local_cases(), "dist": dist_cases(), "decode": decode_cases(),
            "mha": mha_cases()}  # fmt: skip


def compute_pinned() -> dict[str, dict]:
    """:func:`compute` in a fresh process under :data:`PINNED`."""
    env = {**os.environ, **PINNED}
    res = subprocess.run([sys.executable, __file__, "--print"], env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"reference_outputs failed:\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if "--print" in sys.argv:
        print(json.dumps(compute()))
    elif "--write" in sys.argv:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(compute_pinned(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DATA}")
    else:
        print(__doc__)
