// A scenario whose two sides hold the same model in different dtypes: each
// side laid out from its own manifest by the recipes, then joined.

#include <unordered_set>

#include "planner/conversion.h"
#include "planner/recipes/recipe.h"

namespace refit {
namespace {

Status add_tensors(Layout& layout, const Manifest& model, const std::string& name) {
  std::unordered_set<std::string_view> names;
  names.reserve(model.size());
  layout.tensors.reserve(model.size());
  for (const ManifestTensor& t : model) {
    if (!names.insert(t.name).second)
      return Status::invalid("manifest \"" + name + "\": tensor \"" + t.name + "\" is named twice");
    layout.add_tensor(t.name, t.dtype, t.shape);
  }
  return Status::ok();
}

}  // namespace

Result<Layout> layout_from_scenario_models(const Scenario& scenario, const Manifest& train_model,
                                           const Manifest& infer_model, const std::array<int64_t, 2>& block) {
  Layout sources;
  REFIT_RETURN_IF_ERROR(add_tensors(sources, train_model, scenario.train.model));
  const std::string train_where = "training side, model \"" + scenario.train.model + "\"";
  if (scenario.train.fsdp)
    REFIT_RETURN_IF_ERROR(add_fsdp_sources(sources, scenario.train, train_model).with_context(train_where));
  else
    REFIT_RETURN_IF_ERROR(add_megatron_sources(sources, scenario.train, train_model).with_context(train_where));

  Layout receivers;
  REFIT_RETURN_IF_ERROR(add_tensors(receivers, infer_model, scenario.infer.model));
  REFIT_RETURN_IF_ERROR(add_vllm_receivers(receivers, scenario.infer, infer_model)
                            .with_context("inference side, model \"" + scenario.infer.model + "\""));
  receivers.weight_block_size = block;
  auto joined = join_sides(std::move(sources), std::move(receivers));
  if (!joined) {
    return joined.status().with_context("scenario from \"" + scenario.train.model + "\" to \"" +
                                        scenario.infer.model + "\"");
  }
  return joined;
}

}  // namespace refit
