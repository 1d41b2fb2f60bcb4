#pragma once
// Recipes: a parallelism description and a model manifest in, an explicit
// Layout out (docs/formats.md, "How the recipes place the
// weights"). The training side is laid out as
// Megatron-Core (or torchtitan/FSDP2 when the scenario says "fsdp": true) lays
// out its parameters; the inference side as vLLM does. Buffers carry the
// framework's own parameter names; the logical tensors are the manifest's
// Hugging Face names.

#include "planner/layout.h"
#include "planner/manifest.h"
#include "planner/scenario.h"
#include "planner/status.h"

namespace refit {

// Both sides of `scenario` for `model`: ranks, domains (consecutive blocks of
// gpus_per_domain ranks), instances, tensors, buffers and regions. Fails with
// a message naming the tensor when a tensor matches no rule or a size does not
// divide as the framework requires.
Result<Layout> layout_from_scenario(const Scenario& scenario, const Manifest& model);

// The two halves, for callers (the C ABI, the Python adapters) that need one
// side only. Each adds its ranks, buffers and regions to `layout`, whose
// tensors must already hold every manifest tensor in manifest order.
Status add_megatron_sources(Layout& layout, const TrainSide& train, const Manifest& model);
Status add_fsdp_sources(Layout& layout, const TrainSide& train, const Manifest& model);
Status add_vllm_receivers(Layout& layout, const InferSide& infer, const Manifest& model);

}  // namespace refit
