#pragma once
// Block quantization on device buffers: quantize_e4m3_blocks (convert.h)
// with every pointer of QuantizeArgs in device memory, same bits, same
// refusals (NaN or infinity in a block: nothing written). Built when CUDA,
// NCCL and nvcc are found (REFIT_HAVE_CONVERT_KERNEL).

#include "planner/status.h"
#include "transport/convert/convert.h"

namespace refit::convert {

// Enqueues the kernels on `stream` (a cudaStream_t; null: the legacy
// default stream) and waits for them. Uses a scratch allocation of 8 bytes
// plus 4 per block, freed before it returns.
Status quantize_e4m3_blocks_cuda(const QuantizeArgs& args, void* stream);

}  // namespace refit::convert
