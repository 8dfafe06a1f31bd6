// CPU kernels of the block operators (registered in csrc/ops.cpp).
#pragma once

#include "../block_call.h"

namespace ring_attention::cpu {

void block_forward(const BlockCall& call);
void block_backward(const BlockCall& call);

}  // namespace ring_attention::cpu
