// csrc/cuda/block_backward.cu built for the CPU emulator (runtime.h).
#define RING_ATTENTION_CUDA_EMULATOR <cuda_emulator/runtime.h>
#include "../../csrc/cuda/block_backward.cu"

namespace ring_attention::emulated {

void block_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                    const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                    const std::optional<at::Tensor>& dv, int64_t q_start, int64_t k_start,
                    at::IntArrayRef segs, at::IntArrayRef dils, bool causal, double scale,
                    bool head_groups, const std::optional<at::Tensor>& kpm) {
  gpu::block_backward_cuda(grad_out, q, k, v, out, lse, dq, dk, dv, q_start, k_start, segs, dils,
                           causal, scale, head_groups, kpm);
}

}  // namespace ring_attention::emulated
