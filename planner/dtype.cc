#include "planner/dtype.h"

#include <array>

namespace refit {
namespace {

struct Info {
  DType type;
  std::string_view name;
  int bytes;
};

constexpr std::array<Info, 12> kInfo = {{
    {DType::kBF16, "BF16", 2},   {DType::kF16, "F16", 2},        {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},     {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kI8, "I8", 1},       {DType::kU8, "U8", 1},          {DType::kI16, "I16", 2},
    {DType::kI32, "I32", 4},     {DType::kI64, "I64", 8},        {DType::kBool, "BOOL", 1},
}};

}  // namespace

std::optional<DType> parse_dtype(std::string_view name) {
  for (const Info& i : kInfo) {
    if (i.name == name) return i.type;
  }
  return std::nullopt;
}

std::string_view dtype_name(DType t) { return kInfo[static_cast<int>(t)].name; }
int dtype_bytes(DType t) { return kInfo[static_cast<int>(t)].bytes; }

}  // namespace refit
