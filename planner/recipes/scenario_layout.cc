// A whole scenario: the manifest's tensors, then the training side (megatron
// or fsdp), then the inference side (vllm).

#include <unordered_set>

#include "planner/recipes/recipe.h"

namespace refit {

Result<Layout> layout_from_scenario(const Scenario& scenario, const Manifest& model) {
  Layout layout;
  layout.tensors.reserve(model.size());
  std::unordered_set<std::string_view> names;
  names.reserve(model.size());
  for (const ManifestTensor& t : model) {
    if (!names.insert(t.name).second)
      return Status::invalid("manifest \"" + scenario.model + "\": tensor \"" + t.name + "\" is named twice");
    layout.add_tensor(t.name, t.dtype, t.shape);
  }
  const std::string where = "scenario for model \"" + scenario.model + "\"";
  if (scenario.train.fsdp)
    REFIT_RETURN_IF_ERROR(add_fsdp_sources(layout, scenario.train, model).with_context(where));
  else
    REFIT_RETURN_IF_ERROR(add_megatron_sources(layout, scenario.train, model).with_context(where));
  REFIT_RETURN_IF_ERROR(add_vllm_receivers(layout, scenario.infer, model).with_context(where));
  return layout;
}

}  // namespace refit
