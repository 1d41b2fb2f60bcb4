#pragma once
// A small Llama-like model manifest shared by tests: 2 layers, hidden 128,
// 4 heads and 2 KV heads of 32, q_norm/k_norm, MLP 256, vocabulary 1001
// (odd on purpose, so that vocabulary padding shows).

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace refit::testing {

inline nlohmann::json small_llama_manifest() {
  using nlohmann::json;
  json m = json::object();
  auto t = [](std::vector<int64_t> shape) { return json{{"shape", shape}, {"dtype", "BF16"}}; };
  m["model.embed_tokens.weight"] = t({1001, 128});
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    m[p + ".input_layernorm.weight"] = t({128});
    m[p + ".self_attn.q_proj.weight"] = t({128, 128});
    m[p + ".self_attn.k_proj.weight"] = t({64, 128});
    m[p + ".self_attn.v_proj.weight"] = t({64, 128});
    m[p + ".self_attn.o_proj.weight"] = t({128, 128});
    m[p + ".self_attn.q_norm.weight"] = t({32});
    m[p + ".self_attn.k_norm.weight"] = t({32});
    m[p + ".post_attention_layernorm.weight"] = t({128});
    m[p + ".mlp.gate_proj.weight"] = t({256, 128});
    m[p + ".mlp.up_proj.weight"] = t({256, 128});
    m[p + ".mlp.down_proj.weight"] = t({128, 256});
  }
  m["model.norm.weight"] = t({128});
  m["lm_head.weight"] = t({1001, 128});
  return m;
}

// Its Hugging Face config (written beside the manifest as NAME.config.json).
inline nlohmann::json small_llama_config() {
  return {{"architectures", {"Qwen3ForCausalLM"}}, {"num_hidden_layers", 2},  {"hidden_size", 128},
          {"num_attention_heads", 4},              {"num_key_value_heads", 2}, {"head_dim", 32},
          {"intermediate_size", 256},              {"vocab_size", 1001},       {"tie_word_embeddings", false}};
}

}  // namespace refit::testing
