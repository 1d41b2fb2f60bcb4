#pragma once
// Model manifests: a safetensors header without offsets, in Hugging Face names
//   {"model.norm.weight": {"shape": [4096], "dtype": "BF16"}, ...}
// or the header of a real .safetensors file (8-byte little-endian length, then
// the same JSON with "data_offsets", and an optional "__metadata__").
// Parsing is pure: callers read the bytes.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "planner/dtype.h"
#include "planner/model_config.h"
#include "planner/status.h"

namespace refit {

struct ManifestTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
};

// A model: its tensors in the order the JSON lists them (deterministic for a
// given file), and its Hugging Face config, which the recipes need for what
// shapes do not tell (heads, head_dim, tied embeddings, experts, MLA ranks,
// FP8 blocks). The parsers below fill the tensors only; the caller reads the
// config (model_config.h says where it lies) and sets `config`. A manifest
// without one lays out nothing: the recipes name the key they lack.
struct Manifest : std::vector<ManifestTensor> {
  using std::vector<ManifestTensor>::vector;
  ModelConfig config;
};

// Parses manifest JSON text. `origin` (a file name) starts every message.
Result<Manifest> parse_manifest_json(std::string_view json_text, const std::string& origin);

// Parses the header of a .safetensors file given its first bytes (at least
// the 8-byte length and the header it announces; `file_size` is the whole
// file's size, for checking that the header and data_offsets fit).
Result<Manifest> parse_safetensors_header(std::string_view bytes, uint64_t file_size, const std::string& origin);

// Joins shards of one checkpoint; a tensor named twice is an error.
Status merge_manifest(Manifest& into, Manifest&& more, const std::string& origin);

}  // namespace refit
