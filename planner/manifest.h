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
#include "planner/status.h"

namespace refit {

struct ManifestTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
};

// In the order the JSON lists them (deterministic for a given file).
using Manifest = std::vector<ManifestTensor>;

// Parses manifest JSON text. `origin` (a file name) starts every message.
Result<Manifest> parse_manifest_json(std::string_view json_text, const std::string& origin);

// Parses the header of a .safetensors file given its first bytes (at least
// the 8-byte length and the header it announces; `file_size` is the whole
// file's size, for checking that the header and data_offsets fit).
Result<Manifest> parse_safetensors_header(std::string_view bytes, uint64_t file_size, const std::string& origin);

// Joins shards of one checkpoint; a tensor named twice is an error.
Status merge_manifest(Manifest& into, Manifest&& more, const std::string& origin);

}  // namespace refit
