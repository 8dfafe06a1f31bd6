"""One forward (and backward) of ``ra.dilated_attention`` on our kernels, for a
profiler: ``scripts/gpu_check.sh --stages profile`` runs it under Nsight Compute
(ncu), which records the CUDA kernels' launches. Our kernels both ways
(``RING_ATTENTION_FORWARD`` / ``RING_ATTENTION_BACKWARD`` set to ``kernel``
unless given), LongNet pattern, random inputs.

    python3 scripts/profile_kernels.py --n 32768 --heads 16 --head-dim 128 --backward
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("RING_ATTENTION_FORWARD", "kernel")
os.environ.setdefault("RING_ATTENTION_BACKWARD", "kernel")

import torch

import ring_attention as ra

SEGMENTS = [2048, 4096, 8192, 16384, 32768]
DILATIONS = [1, 2, 4, 6, 12]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backward", action="store_true", help="also the backward")
    a = p.parse_args()
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (1, a.n, a.heads, a.head_dim)
    q, k, v, g = (torch.randn(shape, generator=gen, device=dev, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(a.backward)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(a.backward):
        out = ra.dilated_attention(q, k, v, SEGMENTS, DILATIONS)
        if a.backward:
            out.backward(g)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    paths = f"forward {os.environ['RING_ATTENTION_FORWARD']}"
    if a.backward:
        paths += f", backward {os.environ['RING_ATTENTION_BACKWARD']}"
    print(
        f"profile_kernels: n={a.n} h={a.heads} d={a.head_dim} {a.dtype} on {a.device} ({paths}): "
        f"{time.perf_counter() - t0:.3f} s, out finite: {bool(out.isfinite().all())}"
    )


if __name__ == "__main__":
    main()
