// csrc/cuda/merge.cu built for the CPU emulator (runtime.h).
#define RING_ATTENTION_CUDA_EMULATOR <cuda_emulator/runtime.h>
#include "../../csrc/cuda/merge.cu"
