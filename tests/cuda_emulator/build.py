"""Build and load the CPU emulation of the CUDA block kernels.

``load()`` compiles ``csrc/cuda/block_{forward,backward}.cu`` and
``csrc/cuda/merge.cu`` for the CPU
against ``runtime.h`` (next to this file) into ``build/cuda_emulator/`` and
returns ``torch.ops.ring_attention_emulated``. It needs the CUDA toolkit's
headers (``cuda_fp16.h``; nothing from them runs on a GPU) and returns ``None``
with the reason in ``MISSING`` when they are absent.
"""

from __future__ import annotations

import os

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = [
    os.path.join(HERE, "ops.cpp"),
    os.path.join(HERE, "block_forward.cpp"),
    os.path.join(HERE, "block_backward.cpp"),
    os.path.join(HERE, "merge_rows.cpp"),
    os.path.join(ROOT, "csrc", "checks.cpp"),
    os.path.join(ROOT, "csrc", "block_call.cpp"),
    os.path.join(ROOT, "csrc", "merge.cpp"),
]
MISSING = ""


def cuda_include_dir() -> str | None:
    """The CUDA toolkit's include directory, if it has the fp16/bf16 headers."""
    homes = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for home in homes:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_bf16.h")):
            return os.path.join(home, "include")
    return None


def load():
    """Build (when sources changed) and load the emulator; its ops namespace."""
    global MISSING
    include = cuda_include_dir()
    if include is None:
        MISSING = "CUDA toolkit headers (cuda_bf16.h) not found; set CUDA_HOME"
        return None
    # scripts/sanitize.sh builds a sanitized copy (its own build directory).
    from ring_attention.core.config import emulator_sanitize

    sanitize = emulator_sanitize()
    name = "cuda_emulator_sanitized" if sanitize else "cuda_emulator"
    build_dir = os.path.join(ROOT, "build", name)
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(
        name="ring_attention_emulated",
        sources=SOURCES,
        extra_include_paths=[os.path.dirname(HERE), include],
        extra_cflags=["-O2", "-std=c++20", "-Wno-attributes", "-fno-strict-aliasing", *sanitize],
        extra_ldflags=sanitize,
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.ring_attention_emulated
