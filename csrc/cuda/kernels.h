// CUDA kernels of the block operators (registered in cuda/registration.cpp;
// the test suite's CPU emulator registers the same functions as its own ops).
#pragma once

#include "../block_call.h"

namespace ring_attention::gpu {

void block_forward(const BlockCall& call);
void block_backward(const BlockCall& call);

}  // namespace ring_attention::gpu
