#pragma once
// A model's Hugging Face config (config.json): the facts a layout needs that
// shapes alone do not give. k_proj of 512 rows is 8 KV heads of 64
// (Llama-3.2-1B) or 4 of 128, and vLLM lays the two out differently once tp
// exceeds the KV heads; so the recipes take head counts and head_dim from
// here and never guess them. Parsing is pure: callers read the bytes.
//
// Only the keys below are read; a config has many more, which are ignored.
// A key that is present with the wrong type is an error naming it. A key that
// is absent stays empty, and the recipe that needs it refuses naming it
// (ModelConfig::require).

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "planner/status.h"

namespace refit {

struct ModelConfig {
  // The file it was read from, for messages; empty when no config was read.
  std::string origin;

  std::optional<int64_t> num_attention_heads;
  std::optional<int64_t> num_key_value_heads;
  std::optional<int64_t> head_dim;  // else hidden_size / num_attention_heads
  std::optional<int64_t> hidden_size;
  std::optional<int64_t> vocab_size;
  std::optional<bool> tie_word_embeddings;
  std::optional<int64_t> num_experts;  // "num_experts" (Qwen) or "n_routed_experts" (DeepSeek)
  std::optional<int64_t> moe_intermediate_size;
  std::optional<int64_t> first_k_dense_replace;
  // MLA. q_lora_rank is null in DeepSeek-V2-Lite (no query LoRA): has_q_lora_rank
  // tells a null from an absent key.
  bool has_q_lora_rank = false;
  std::optional<int64_t> q_lora_rank;
  std::optional<int64_t> kv_lora_rank;
  std::optional<int64_t> qk_nope_head_dim;
  std::optional<int64_t> qk_rope_head_dim;
  std::optional<int64_t> v_head_dim;
  // quantization_config.weight_block_size: FP8 block scales [rows, cols].
  std::optional<std::array<int64_t, 2>> weight_block_size;

  bool present() const { return !origin.empty(); }

  // `value` or an error naming `key` and the file: "qwen.config.json: the
  // key "num_key_value_heads" is missing; the layout of <why> needs it".
  Result<int64_t> require(const std::optional<int64_t>& value, std::string_view key, std::string_view why) const;

  // head_dim, else hidden_size / num_attention_heads (Hugging Face's own
  // rule), else an error naming the missing key.
  Result<int64_t> attention_head_dim(std::string_view why) const;
};

// Parses config.json text. `origin` (the file name) starts every message.
Result<ModelConfig> parse_model_config(std::string_view json_text, const std::string& origin);

// Where a model's config lies: "<dir>/config.json" for a checkpoint folder,
// "<stem>.config.json" beside a manifest "<stem>.json" or "<stem>.safetensors".
std::string model_config_path(const std::string& model_path, bool is_folder);

}  // namespace refit
