// csrc/cuda/block_backward.cu built for the CPU emulator (runtime.h).
#define RING_ATTENTION_CUDA_EMULATOR <cuda_emulator/runtime.h>
#include "../../csrc/cuda/block_backward.cu"
