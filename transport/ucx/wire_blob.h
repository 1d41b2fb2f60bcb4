#pragma once
// Worker addresses and packed rkeys travel through the control plane as
// opaque bytes. UCX parses its own address and rkey formats without checking
// them, so garbage from the wire could crash it; refit frames each blob with
// a magic, a kind, a length and a checksum and checks them before UCX sees
// a byte. Pure C++: no UCX.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "planner/status.h"

namespace refit::ucx {

enum class BlobKind : uint16_t {
  kWorkerAddress = 1,
  kRemoteKey = 2,
};

// A remote key blob also carries the registered region it opens, so that a
// receiver can check every run against it before issuing a GET.
struct RemoteKeyHeader {
  uint64_t base = 0;
  uint64_t length = 0;
};

// Frames `payload` (with an optional region for kRemoteKey).
std::vector<uint8_t> frame_blob(BlobKind kind, std::span<const uint8_t> payload,
                                RemoteKeyHeader region = {});

struct UnframedBlob {
  std::span<const uint8_t> payload;  // borrows from the framed bytes
  RemoteKeyHeader region;
};

// Checks magic, version, kind, length and checksum. `what` names the blob in
// the error message (e.g. `endpoint "trainer-3" worker address`).
Result<UnframedBlob> unframe_blob(BlobKind kind, std::span<const uint8_t> bytes,
                                  const std::string& what);

}  // namespace refit::ucx
