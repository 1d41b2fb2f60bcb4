#pragma once
// Element types, by their safetensors names.

#include <cstdint>
#include <optional>
#include <string_view>

namespace refit {

enum class DType : uint8_t { kBF16, kF16, kF32, kF64, kF8E4M3, kF8E5M2, kI8, kU8, kI16, kI32, kI64, kBool };

// "BF16" -> kBF16; nullopt for a name that is not one of FORMATS' dtypes.
std::optional<DType> parse_dtype(std::string_view name);
std::string_view dtype_name(DType t);
int dtype_bytes(DType t);

}  // namespace refit
