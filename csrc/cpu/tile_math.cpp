#include "tile_math.h"

namespace ring_attention::cpu {

bool brgemm_f32_available() {
  // Probe once: ATen raises where oneDNN's ukernel does not support fp32.
  static const bool available = [] {
    try {
      const float a = 1.f, b = 2.f;
      float c = 0.f;
      at::native::cpublas::brgemm(1, 1, 1, 1, 1, 1, false, &a, &b, &c);
      at::native::cpublas::brgemm_release(false);
      return c == 2.f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return available;
}

}  // namespace ring_attention::cpu
