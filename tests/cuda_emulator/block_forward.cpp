// csrc/cuda/block_forward.cu built for the CPU emulator (runtime.h).
#define RING_ATTENTION_CUDA_EMULATOR <cuda_emulator/runtime.h>
#include "../../csrc/cuda/block_forward.cu"

namespace ring_attention::emulated {

void block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                   at::Tensor& lse, int64_t q_start, int64_t k_start, at::IntArrayRef segs,
                   at::IntArrayRef dils, bool causal, double scale, bool head_groups,
                   const std::optional<at::Tensor>& kpm) {
  gpu::block_forward_cuda(q, k, v, out, lse, q_start, k_start, segs, dils, causal, scale,
                          head_groups, kpm);
}

}  // namespace ring_attention::emulated
