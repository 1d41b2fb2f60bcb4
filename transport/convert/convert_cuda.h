#pragma once
// Block quantization on device buffers: quantize_e4m3_blocks (convert.h)
// with every pointer of QuantizeArgs in device memory, same bits, same
// refusals (NaN or infinity in a block: nothing written). Built when CUDA,
// NCCL and nvcc are found (REFIT_HAVE_CONVERT_KERNEL).
//
// Each call runs on the GPU that holds its destination: that device is made
// current for the call (its scratch, copies and kernels go there) and the
// calling thread's device is restored before it returns. A destination that
// is not GPU memory is refused. `stream` must belong to that device.

#include <cstdint>
#include <span>
#include <string_view>

#include "planner/status.h"
#include "transport/convert/convert.h"

namespace refit::convert {

// Enqueues the kernels on `stream` (a cudaStream_t; null: the legacy
// default stream) and waits for them. Uses a scratch allocation of 8 bytes
// plus 4 per block, freed before it returns.
Status quantize_e4m3_blocks_cuda(const QuantizeArgs& args, void* stream);

// quantize_e4m3_blocks_cuda with `args.src` in host memory (a receiver's
// conversion staging area, docs/conversion.md) and `dst` and `scales` on the
// device: the source rows (rows x src_stride elements) are copied to a
// device scratch first, freed before it returns.
Status quantize_e4m3_blocks_cuda_from_host(const QuantizeArgs& args, void* stream);

// relayout_box (relayout.h) of a box staged in host memory into device
// memory at `dst`: the box is copied to a device scratch, then the CUDA
// relayout kernel writes it into `strides`; waits, frees the scratch.
Status relayout_box_cuda_from_host(const uint8_t* src, uint8_t* dst, int elem_bytes, std::span<const int64_t> sizes,
                                   std::span<const int64_t> strides, std::string_view tensor, void* stream);

// cast() of `n` host elements at `src` into device memory at `dst`: cast
// on the host, then one copy.
Status cast_to_device(DType from, DType to, const void* src, void* dst, int64_t n, std::string_view tensor,
                      void* stream);

}  // namespace refit::convert
