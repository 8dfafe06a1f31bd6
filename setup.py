"""Build ring_attention._C: a C++ extension, or a CUDA extension when the
installed torch has CUDA and a CUDA toolkit is found."""

import glob
import os
import platform

import torch
from setuptools import setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    include_paths,
)

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cpu_vector_flags() -> list[str]:
    """AVX-512 (else AVX2/FMA) code for the CPU kernels when the build machine
    has it (the extension is built where it runs): the softmax passes run 16
    floats wide. RING_ATTENTION_GENERIC_CPU=1 opts out."""
    if os.environ.get("RING_ATTENTION_GENERIC_CPU") == "1" or platform.machine() != "x86_64":
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return []
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")):
        return [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mf16c",
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
            # GCC 12's AVX-512 intrinsics (_mm512_undefined_*) trip it in headers.
            "-Wno-maybe-uninitialized",
        ]
    if "avx2" in flags and "fma" in flags:
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def _default_arch_list() -> str:
    """The visible GPU's architecture; with none visible (a build machine),
    Ampere and Hopper machine code plus PTX that newer GPUs compile at load
    (sm_80 code alone would not run on an H100: "no kernel image")."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "8.0;9.0+PTX"


def _extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # -fopenmp: at::parallel_for is an inline OpenMP template; without it the
    # CPU kernels run on one thread and BLAS forks its own team per tile.
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-fopenmp", "-Wall", "-Wextra"]
    # PyTorch's headers as system headers: -Wall -Wextra report our code only.
    cxx += [f"-isystem{d}" for d in include_paths()] + _cpu_vector_flags()
    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("RING_ATTENTION_CPU_ONLY") != "1"
    )
    if not with_cuda:
        return CppExtension(
            "ring_attention._C",
            sources,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = _default_arch_list()
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    # csrc/cuda/*.cpp: the CUDA build's host-only code (its registrations).
    return CUDAExtension(
        "ring_attention._C",
        sources + sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu")),
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
