#include "planner/model_config.h"

#include <nlohmann/json.hpp>

#include "planner/json_util.h"

namespace refit {
namespace {

using nlohmann::json;
using json_util::show;

// Sizes above this are typos, not models; it also keeps products of sizes
// (heads * head_dim) far from overflow.
constexpr int64_t kMaxSize = int64_t{1} << 40;

Status read_size(const json& doc, const std::string& origin, const char* key, std::optional<int64_t>* out,
                 bool null_ok = false) {
  auto it = doc.find(key);
  if (it == doc.end()) return Status::ok();
  if (it->is_null() && null_ok) return Status::ok();
  if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxSize)
    return Status::invalid(origin + ": \"" + key + "\" must be a positive integer, got " + show(*it));
  *out = it->get<int64_t>();
  return Status::ok();
}

}  // namespace

Result<int64_t> ModelConfig::require(const std::optional<int64_t>& value, std::string_view key,
                                     std::string_view why) const {
  if (value) return *value;
  if (!present())
    return Status::invalid("the model has no Hugging Face config (config.json in a checkpoint folder, NAME.config.json "
                           "beside a manifest NAME.json); the layout of " +
                           std::string(why) + " needs its \"" + std::string(key) + "\"");
  return Status::invalid(origin + ": the key \"" + std::string(key) + "\" is missing; the layout of " +
                         std::string(why) + " needs it");
}

Result<int64_t> ModelConfig::attention_head_dim(std::string_view why) const {
  if (head_dim) return *head_dim;
  if (!hidden_size || !num_attention_heads) {
    auto missing = require(head_dim, "head_dim", why);
    return Status::invalid(missing.status().message() + " (or \"hidden_size\" and \"num_attention_heads\" to derive it)");
  }
  if (*hidden_size % *num_attention_heads != 0)
    return Status::invalid(origin + ": no \"head_dim\", and \"hidden_size\" " + std::to_string(*hidden_size) +
                           " is not a multiple of \"num_attention_heads\" " + std::to_string(*num_attention_heads));
  return *hidden_size / *num_attention_heads;
}

Result<ModelConfig> parse_model_config(std::string_view json_text, const std::string& origin) {
  json doc = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::invalid(origin + ": not valid JSON");
  if (!doc.is_object()) return Status::invalid(origin + ": a Hugging Face config must be a JSON object, got " + show(doc));
  ModelConfig c;
  c.origin = origin;
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "num_attention_heads", &c.num_attention_heads));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "num_key_value_heads", &c.num_key_value_heads));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "head_dim", &c.head_dim, /*null_ok=*/true));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "hidden_size", &c.hidden_size));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "vocab_size", &c.vocab_size));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "moe_intermediate_size", &c.moe_intermediate_size));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "kv_lora_rank", &c.kv_lora_rank));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "qk_nope_head_dim", &c.qk_nope_head_dim));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "qk_rope_head_dim", &c.qk_rope_head_dim));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "v_head_dim", &c.v_head_dim));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "q_lora_rank", &c.q_lora_rank, /*null_ok=*/true));
  c.has_q_lora_rank = doc.contains("q_lora_rank");

  std::optional<int64_t> experts, routed;
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "num_experts", &experts, /*null_ok=*/true));
  REFIT_RETURN_IF_ERROR(read_size(doc, origin, "n_routed_experts", &routed, /*null_ok=*/true));
  if (experts && routed && *experts != *routed)
    return Status::invalid(origin + ": \"num_experts\" " + std::to_string(*experts) + " and \"n_routed_experts\" " +
                           std::to_string(*routed) + " disagree");
  c.num_experts = experts ? experts : routed;

  if (auto it = doc.find("first_k_dense_replace"); it != doc.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > kMaxSize)
      return Status::invalid(origin + ": \"first_k_dense_replace\" must be a non-negative integer, got " + show(*it));
    c.first_k_dense_replace = it->get<int64_t>();
  }
  if (auto it = doc.find("tie_word_embeddings"); it != doc.end()) {
    if (!it->is_boolean())
      return Status::invalid(origin + ": \"tie_word_embeddings\" must be true or false, got " + show(*it));
    c.tie_word_embeddings = it->get<bool>();
  }
  if (auto q = doc.find("quantization_config"); q != doc.end() && !q->is_null()) {
    if (!q->is_object())
      return Status::invalid(origin + ": \"quantization_config\" must be an object, got " + show(*q));
    if (auto b = q->find("weight_block_size"); b != q->end() && !b->is_null()) {
      if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || !(*b)[1].is_number_integer() ||
          (*b)[0].get<int64_t>() < 1 || (*b)[1].get<int64_t>() < 1)
        return Status::invalid(origin + ": \"quantization_config.weight_block_size\" must be [rows, cols] of "
                               "positive integers, got " + show(*b));
      c.weight_block_size = std::array<int64_t, 2>{(*b)[0].get<int64_t>(), (*b)[1].get<int64_t>()};
    }
  }
  return c;
}

std::string model_config_path(const std::string& model_path, bool is_folder) {
  if (is_folder) {
    std::string dir = model_path;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    return dir + "/config.json";
  }
  std::string stem = model_path;
  for (std::string_view ext : {".safetensors", ".json"}) {
    if (stem.size() > ext.size() && stem.compare(stem.size() - ext.size(), ext.size(), ext) == 0) {
      stem.resize(stem.size() - ext.size());
      break;
    }
  }
  return stem + ".config.json";
}

}  // namespace refit
