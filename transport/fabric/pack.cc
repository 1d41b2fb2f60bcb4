#include "transport/fabric/pack.h"

namespace refit::fabric {

Status validate(const PackLimits& limits) {
  if (limits.pack_bytes != 0 && limits.pack_bytes < kMinPackBytes) {
    return Status::invalid("nccl fabric: \"pack_bytes\" must be 0 (packing off) or at least " +
                           std::to_string(kMinPackBytes) + ", got " + std::to_string(limits.pack_bytes));
  }
  if (limits.pack_threshold == 0) {
    return Status::invalid("nccl fabric: \"pack_threshold\" must be positive, got 0");
  }
  return Status::ok();
}

uint64_t pack_share(const PackLimits& limits, size_t domain_size) {
  if (limits.pack_bytes == 0 || domain_size < 2) return 0;
  const uint64_t share = limits.pack_bytes / (domain_size - 1);
  return share / kPackAlign * kPackAlign;
}

PackLayout plan_pack(std::span<const uint64_t> sizes, uint64_t share, uint64_t threshold) {
  PackLayout out;
  out.offset.reserve(sizes.size());
  for (const uint64_t b : sizes) {
    if (share == 0 || b >= threshold || b > share) {
      out.offset.push_back(kUnpacked);
      ++out.taken;
      continue;
    }
    const uint64_t at = (out.bytes + kPackAlign - 1) / kPackAlign * kPackAlign;
    if (at + b > share) break;
    out.offset.push_back(at);
    out.bytes = at + b;
    ++out.packed;
    ++out.taken;
  }
  return out;
}

}  // namespace refit::fabric
