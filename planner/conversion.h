#pragma once
// Dtype conversion on the way (docs/conversion.md): a tensor whose
// receivers hold another dtype than its sources. What refit converts, what
// it refuses, the block scales it derives, and the bytes each side moves.
//
// A layout says it by its receivers' buffers: Tensor::dtype is the sources'
// dtype, Tensor::receiver_dtype the receivers'. BF16 or F32 to F8_E4M3 is
// block quantization with one F32 scale per block of
// Layout::weight_block_size over the last two dims; the scales land in the
// receivers' tensor "<name>_scale_inv" (DeepSeek's and vLLM's
// "W.weight_scale_inv"), which the receivers compute: a derived tensor with
// no sources. The kernels are transport/convert's.
//
// Pure functions over a Layout or a Plan; a Layout is changed only by
// resolve_conversions and join_sides.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "planner/layout.h"
#include "planner/manifest.h"
#include "planner/plan.h"
#include "planner/scenario.h"
#include "planner/status.h"

namespace refit {

enum class ConversionKind : uint8_t {
  kNone,          // same dtype on both sides
  kCast,          // F32 -> BF16, F32 -> F16, BF16 -> F16: round to nearest even
  kQuantizeE4M3,  // BF16 or F32 -> F8_E4M3 with F32 block scales
};

// How refit converts tensor `tensor` from `from` to `to`. Refused, naming
// the tensor and both dtypes: a narrower type to a wider one (F8_E4M3 to
// BF16 would need the scales to dequantize, which refit does not do), any
// integer or BOOL dtype on either side, F8_E5M2, F64.
Result<ConversionKind> conversion_for(const std::string& tensor, DType from, DType to);

// "<weight>_scale_inv": "model.layers.0.mlp.down_proj.weight" ->
// "model.layers.0.mlp.down_proj.weight_scale_inv".
std::string scale_tensor_name(const std::string& weight);

// The scale tensor's shape: `shape` with its last two dims divided by the
// block, rounded up (a tensor edge is a partial block).
std::vector<int64_t> scale_shape(const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block);

// A box of a tensor's index space: [start[d], start[d] + size[d]) per dim.
struct IndexBox {
  std::vector<int64_t> start, size;
};

// The box of the scale tensor that holds the scales of the blocks the weight
// box (start, size) touches: its leading dims as they are, its last two in
// blocks (the start rounded down, the end up). Of a box of whole blocks,
// exactly its blocks' scales, in the order transport/convert writes them.
IndexBox scale_box_of(const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                      const std::array<int64_t, 2>& block);

// A box of a tensor quantized on the way cut by blocks (docs/conversion.md,
// "At the source"): `whole`, its largest sub-box of whole blocks of `block`
// in the last two dims (a block at the tensor's edge may be partial; empty
// when the box holds no whole block), and `rest`, the box less `whole` in
// at most four boxes, each in blocks the box cuts. A box of whole blocks is
// all `whole`.
struct BlockSplit {
  Box whole;
  std::vector<Box> rest;
};
BlockSplit split_whole_blocks(const Box& box, const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block);

// Checks every tensor whose receivers hold another dtype than its sources,
// and marks the scale tensors derived (Tensor::derived_from). Refused, with
// the tensor named: an unsupported conversion (conversion_for); a quantized
// tensor of fewer than 2 dims; its scale tensor missing on the receivers,
// or of another dtype than F32 or another shape than scale_shape, or held
// by sources; a receiver box that cuts a block (its start not on a block
// boundary, or its end neither on one nor at the tensor's edge), naming the
// receiver rank, the box and the block; a receiver rank holding blocks of
// the weight without their scales. Idempotent. Then validate()s the layout.
Status resolve_conversions(Layout& layout);

// True when some tensor's receivers hold another dtype than its sources.
bool has_conversions(const Layout& layout);

// One layout from the sources of `sources` and the receivers of
// `receivers` (each built from its own side's model: a BF16 trainer and an
// FP8 server), tensors matched by name. A tensor of both keeps the sources'
// dtype with the receivers' as Tensor::receiver_dtype; a tensor only the
// receivers have is a scale tensor to derive (resolve_conversions checks
// it) or else refused; a tensor only the sources have and no receiver
// needs is dropped. Shapes must match. Then resolve_conversions.
Result<Layout> join_sides(Layout&& sources, Layout&& receivers);

// Both sides of `scenario` when the trainer holds `train_model` and the
// server `infer_model` (scenario.train.model and .infer.model, the same
// architecture in other dtypes: kimi-k2 in BF16 to kimi-k2-fp8): the
// sources laid out from the first, the receivers from the second (as
// layout_from_scenario does each), joined by join_sides with `block` as the
// weight block size (the server's quantization_config.weight_block_size).
Result<Layout> layout_from_scenario_models(const Scenario& scenario, const Manifest& train_model,
                                           const Manifest& infer_model, const std::array<int64_t, 2>& block);

// Where a quantization runs (docs/conversion.md).
enum class ConvertAt : uint8_t {
  kReceiver,  // the puller converts after landing, before the fan-out
  kSource,    // the source converts the blocks it holds whole; the rest at the receiver
};

// The bytes a plan moves with its conversions done at `at`. The plan itself
// counts every tensor in its sources' dtype (PlanSummary::network_bytes).
struct ConversionBytes {
  int64_t converted_tensors = 0;
  int64_t derived_tensors = 0;       // scale tensors the receivers compute
  int64_t network_bytes = 0;         // over the network, scales included
  int64_t network_scale_bytes = 0;   // of which block scales (kSource only)
  int64_t local_bytes = 0;           // over the local fabric, in the receivers' dtype, scales included
  int64_t local_scale_bytes = 0;     // of which block scales
  int64_t quantized_at_source_bytes = 0;    // source-dtype bytes quantized by a source (kSource)
  int64_t quantized_at_receiver_bytes = 0;  // source-dtype bytes quantized by a puller
};
ConversionBytes count_conversion_bytes(const Plan& plan, ConvertAt at);

}  // namespace refit
