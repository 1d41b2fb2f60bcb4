#include "transport/ucx/wire_blob.h"

#include <cstring>

namespace refit::ucx {
namespace {

constexpr uint32_t kMagic = 0x58554652;  // "RFUX" little-endian
constexpr uint16_t kVersion = 1;

// magic u32, version u16, kind u16, base u64, length u64, payload_len u32,
// checksum u32 (FNV-1a over payload).
constexpr size_t kHeaderBytes = 4 + 2 + 2 + 8 + 8 + 4 + 4;

uint32_t fnv1a(std::span<const uint8_t> bytes) {
  uint32_t h = 2166136261u;
  for (uint8_t b : bytes) {
    h ^= b;
    h *= 16777619u;
  }
  return h;
}

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  uint8_t buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.insert(out.end(), buf, buf + sizeof(T));
}

template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

std::vector<uint8_t> frame_blob(BlobKind kind, std::span<const uint8_t> payload,
                                RemoteKeyHeader region) {
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + payload.size());
  put<uint32_t>(out, kMagic);
  put<uint16_t>(out, kVersion);
  put<uint16_t>(out, static_cast<uint16_t>(kind));
  put<uint64_t>(out, region.base);
  put<uint64_t>(out, region.length);
  put<uint32_t>(out, static_cast<uint32_t>(payload.size()));
  put<uint32_t>(out, fnv1a(payload));
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Result<UnframedBlob> unframe_blob(BlobKind kind, std::span<const uint8_t> bytes,
                                  const std::string& what) {
  if (bytes.size() < kHeaderBytes) {
    return Status::invalid(what + ": " + std::to_string(bytes.size()) +
                           " bytes is shorter than a refit UCX blob header (" +
                           std::to_string(kHeaderBytes) +
                           " bytes); pass the bytes exactly as the peer produced them");
  }
  const uint8_t* p = bytes.data();
  if (get<uint32_t>(p) != kMagic) {
    return Status::invalid(what + ": not a refit UCX blob (bad magic); the bytes are corrupt or "
                           "come from something other than refit");
  }
  uint16_t version = get<uint16_t>(p + 4);
  if (version != kVersion) {
    return Status::unsupported(what + ": blob version " + std::to_string(version) +
                               ", this build reads version " + std::to_string(kVersion) +
                               "; run the same refit version on both sides");
  }
  uint16_t got_kind = get<uint16_t>(p + 6);
  if (got_kind != static_cast<uint16_t>(kind)) {
    return Status::invalid(what + ": blob kind " + std::to_string(got_kind) + ", expected " +
                           std::to_string(static_cast<uint16_t>(kind)) +
                           " (1 = worker address, 2 = remote key)");
  }
  UnframedBlob out;
  out.region.base = get<uint64_t>(p + 8);
  out.region.length = get<uint64_t>(p + 16);
  uint32_t len = get<uint32_t>(p + 24);
  uint32_t sum = get<uint32_t>(p + 28);
  if (len != bytes.size() - kHeaderBytes) {
    return Status::invalid(what + ": header says " + std::to_string(len) +
                           " payload bytes, got " + std::to_string(bytes.size() - kHeaderBytes) +
                           "; the blob was truncated or padded in transit");
  }
  out.payload = bytes.subspan(kHeaderBytes);
  if (fnv1a(out.payload) != sum) {
    return Status::invalid(what + ": checksum mismatch; the blob was corrupted in transit");
  }
  if (kind == BlobKind::kWorkerAddress && len == 0) {
    return Status::invalid(what + ": empty worker address");
  }
  return out;
}

}  // namespace refit::ucx
