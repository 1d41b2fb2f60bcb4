#pragma once
// What an agent registers, from the JSON descriptions the C ABI takes
// (include/refit/refit.h: refit_source_add_tensor, refit_receiver_add_buffer)
// to the coordinator's vocabulary (transport/control/messages.h): tensor
// declarations and buffers of segments. DTensor specs and recipes are
// expanded by the planner's own code (placement.h, recipes/), so an agent
// lays out a shard exactly as the planner would.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "planner/layout.h"
#include "planner/status.h"
#include "plugin/config.h"
#include "transport/control/messages.h"

namespace refit::plugin {

// One buffer of one rank: what the coordinator needs, minus the address and
// rkey the agent adds once it has registered the memory.
// A buffer is bytes: a segment's offset and strides count elements of its
// own dtype (Segment::dtype, "" for `dtype`). A buffer whose segments hold
// several dtypes has dtype U8.
struct BufferPart {
  std::string name;
  std::string dtype;
  int64_t bytes = 0;  // the least the buffer must hold
  std::vector<control::Segment> segments;
  // A recipe's parameter: the buffer must hold exactly `bytes`, since the
  // recipe describes the whole parameter the server allocated.
  bool exact_bytes = false;
};

// A source's tensor: its declaration and where it lies in a buffer.
struct SourceTensor {
  control::TensorDecl decl;
  BufferPart buffer;  // its segments all name decl.name
};

// Parses a refit_source_add_tensor description for source rank `rank`.
// A rank that holds no part of a DTensor gets a buffer with no segments.
Result<SourceTensor> parse_source_tensor(std::string_view json_text, int32_t rank);

// The recipe layout of the receiving side (computed once, then shared by
// every buffer a receiver adds by recipe name).
struct RecipeLayout {
  Layout layout;
};
Result<std::shared_ptr<const RecipeLayout>> load_recipe(const RecipeConfig& recipe);

// Parses a refit_receiver_add_buffer description for receiver rank `rank`.
// `recipe` may be null when the config has none.
Result<BufferPart> parse_receiver_buffer(std::string_view json_text, int32_t rank, const RecipeLayout* recipe);

// The buffers that `rank` of `side` holds in `layout`, with their segments.
std::vector<BufferPart> rank_buffers(const Layout& layout, Side side, int32_t rank);

// Checks that every segment fits in `bytes` of the buffer, each counted in
// elements of its own dtype, and that no two segments share a byte
// (check_segments_apart); the message names the buffer and the segments.
Status check_segments_fit(const BufferPart& part, uint64_t bytes);

// Checks that no two segments of `part` share a byte, whatever their dtypes;
// the message names both segments and their tensors.
Status check_segments_apart(const BufferPart& part);

}  // namespace refit::plugin
