// torch.ops.ring_attention_emulated: the CUDA block operators run by the CPU
// emulator on CPU tensors, plus the emulator's settings and counters.
#include <cuda_emulator/runtime.h>
#include <torch/library.h>

#include "../../csrc/block_ops.h"
#include "../../csrc/cuda/kernels.h"
#include "../../csrc/merge.h"
#include "../../csrc/schemas.h"

namespace ring_attention::emulated {

namespace {

// seed 0 runs fibers and blocks in index order; any other seed shuffles both,
// and an odd one lets each warp run as far ahead of the others as it can.
// The device is that compute capability's, with its opt-in shared memory per
// block (the CUDA C Programming Guide's table of technical specifications).
void configure(int64_t seed, int64_t compute_capability) {
  cuda_emulator::config().seed = static_cast<uint64_t>(seed);
  cuda_emulator::config().compute_capability = static_cast<int>(compute_capability);
  int kib = 227;  // sm_90
  switch (compute_capability) {
    case 70:
      kib = 96;
      break;
    case 75:
      kib = 64;
      break;
    case 80:
      kib = 163;
      break;
    case 86:
    case 89:
      kib = 99;
      break;
    case 90:
      kib = 227;
      break;
    default:
      TORCH_CHECK(false, "configure: no shared-memory limit known for sm_", compute_capability);
  }
  cuda_emulator::config().smem_optin = kib * 1024;
}

// [launches, blocks, warp collectives (lane arrivals), block barriers, then
// whole-warp instructions: __syncwarp, shuffles, votes, mma, ldmatrix] since
// the last call; resets them.
std::vector<int64_t> take_stats() {
  cuda_emulator::Stats& s = cuda_emulator::stats();
  std::vector<int64_t> r{s.launches, s.blocks, s.collectives, s.barriers};
  r.insert(r.end(), std::begin(s.warp_ops), std::end(s.warp_ops));
  s = cuda_emulator::Stats{};
  return r;
}

}  // namespace

TORCH_LIBRARY(ring_attention_emulated, m) {
  m.def(schema::kBlockForward);
  m.def(schema::kBlockBackward);
  m.def(schema::kMergeBranches);
  m.def(schema::kSumBranches);
  m.def("configure(int seed, int compute_capability) -> ()", &configure);
  m.def("take_stats() -> int[]", &take_stats);
}

TORCH_LIBRARY_IMPL(ring_attention_emulated, CPU, m) {
  m.impl("block_forward", &block_forward_op<gpu::block_forward>);
  m.impl("block_backward", &block_backward_op<gpu::block_backward>);
  m.impl("merge_branches", &merge_branches_op<gpu::merge_rows>);
  m.impl("sum_branches", &sum_branches_op<gpu::merge_rows>);
}

}  // namespace ring_attention::emulated
