#pragma once
// The layouts that the bench's baselines execute, derived from the layout of
// a scenario, so that all three strategies run the same library on the same
// tensors and are checked by the same pattern:
//
// - no-dedup: the same buffers, but every receiver rank is a domain of its
//   own, so nothing one rank pulls is shared with another (vLLM's
//   sharded_rdt, NeMo RL's nixl engine).
// - broadcast, the conventional refit (gather, then broadcast whole tensors):
//   stage 1 (gather_layout) has one receiver, the gatherer, that needs every
//   tensor whole from the trainers' sources; stage 2 (spread_layout) has the
//   gatherer as the one source of every whole tensor (Replicate) and every
//   receiver rank, each in a domain of its own, needing the whole of every
//   tensor it touches in a scratch buffer, from which it copies its slices
//   into its real buffers (the original layout's) with memcpy.
//
// A tensor keeps its index in every derived layout. Tensors that no receiver
// needs are left out of both broadcast stages.

#include <string>

#include "planner/layout.h"

namespace refit::bench {

Layout no_dedup_layout(const Layout& layout);
Layout gather_layout(const Layout& layout);
Layout spread_layout(const Layout& layout);

// The name of the stage-2 scratch buffer that holds tensor `tensor` whole.
std::string scratch_buffer_name(const std::string& tensor);

}  // namespace refit::bench
