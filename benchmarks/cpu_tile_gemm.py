"""One-thread micro-benchmark of the CPU kernels' tile products (forward shape:
256 query rows, 512 keys, head dim 64), the figures behind the choices in
csrc/cpu/packed_tiles.h and the kLd padding of csrc/cpu/block_forward.cpp:

* S = Q K^T in bf16 through MKL's gemm_bf16bf16f32 into an fp32 C on a
  cache line or 16 bytes off one (where a large std::vector starts), with
  the row stride of C 512 or 528;
* the same S and O += P V through oneDNN's brgemm (at::native::cpublas) on K
  and V packed once (VNNI), against MKL on the tiles in place;
* fp32: S and P V through sgemm in place against the packed kernels on K^T
  and V copied contiguous (brgemm's where the CPU has AVX-512, the AVX2 ones
  of csrc/cpu/packed_tiles_avx2.cpp where it has AVX2), and a 2048³ torch.mm
  (the sgemm rate the benchmarks compare to);
* where the CPU has AMX, fp32 S as six bf16 part products
  (csrc/cpu/split_products.h), and the splits of its operands;
* the fp32 backward's products at its tile shape (256 rows x 256 keys): S,
  dV^T += dO^T P (the score tile as B) and dQ += dS K;
* the fp32 softmax passes between the two products (csrc/cpu/softmax_rows.h,
  over the 256 x 512 S tile) in each of the lanes the machine runs (at::vec,
  AVX2, AVX-512): a row's first tile (row maximum, then exp and sum) and the
  later ones (one sweep, the running shift kept); with the fp32 products they
  bound the forward's rate, rate <= (S + PV) / (S + PV + pass) of theirs;
* where the CPU has AVX2, S with the later tiles' pass after it or in its
  epilogue (the AVX2 forward's, avx2::gemm_exp).

The bf16 products are timed where the CPU has bf16 dot products (and MKL's
bf16 GEMM, oneDNN's VNNI brgemm), the others where it has their ISA.

    .venv/bin/python benchmarks/bench.py tiles [--iters 2000] [--rounds 5]

Builds a small C++ extension on first use (about 30 s). Microseconds of the
thread's CPU time per product, median of 5 rounds; the 2048³ torch.mm in the
process's CPU time (one thread).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "..", "csrc")
SOURCES = [os.path.join(HERE, "cpu_tile_gemm.cpp"), os.path.join(CSRC, "config.cpp")] + [
    os.path.join(CSRC, "cpu", f"{name}.cpp")
    for name in (
        "softmax_rows",
        "softmax_rows_avx2",
        "split_products",
        "packed_tiles",
        "packed_tiles_avx2",
        "tile_math",
        "tile_path",
    )
]
# The vector code the extension's build picks (setup.py).
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
AVX512_FLAGS += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-Wno-maybe-uninitialized"]
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]


def add_parser(sub) -> None:
    p = sub.add_parser("tiles", help="one-thread timings of the CPU kernels' tile products")
    p.add_argument("--iters", type=int, default=2000, help="products per timing (2000)")
    p.add_argument("--rounds", type=int, default=5, help="timings per product (5)")
    p.set_defaults(func=cmd_tiles)


def cmd_tiles(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O2", "-std=c++20"]
    flags += {"AVX512": AVX512_FLAGS, "AVX2": AVX2_FLAGS}.get(capability, [])
    # Built in this checkout's build/, not torch's shared cache: a build killed
    # there leaves a lock that would stall every checkout's next load.
    build_dir = os.path.join(HERE, "..", "build", "cpu_tile_gemm")
    os.makedirs(build_dir, exist_ok=True)
    ext = load("ra_cpu_tile_gemm", SOURCES, extra_cflags=flags, build_directory=build_dir)
    rounds = [ext.run(args.iters) for _ in range(args.rounds)]
    flops = 2 * 256 * 512 * 64
    shapes = "256 x 512 x 64 products (bwd: 256 x 256 x 64)"
    print(f"one thread, {shapes}; median of {args.rounds} rounds")
    print(f"{'product':<44} {'us':>8} {'GFLOP/s':>9}")
    for name in rounds[0]:
        t = sorted(r[name] for r in rounds)[len(rounds) // 2]
        f = flops // 2 if name.startswith("bwd") else flops  # 256 x 256 x 64
        rate = "" if name.startswith(("pass:", "split:")) else f"{f / t / 1e3:.0f}"
        print(f"{name:<44} {t:8.1f} {rate:>9}")
    x = torch.randn(2048, 2048)
    for _ in range(3):
        x @ x
    t0 = time.process_time()
    for _ in range(10):
        x @ x
    rate = 2 * 2048**3 * 10 / (time.process_time() - t0) / 1e9
    print(f"{'fp32 torch.mm 2048^3 (the sgemm rate)':<44} {'':>8} {rate:9.0f}")
    return 0
