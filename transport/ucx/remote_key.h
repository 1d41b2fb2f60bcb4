#pragma once
// A peer's rkey unpacked on one endpoint, with the region it opens. Move-only;
// must be destroyed before its endpoint closes (Endpoint owns its keys, so
// this holds by construction).

#include <ucp/api/ucp.h>

#include <cstdint>
#include <span>
#include <string>

#include "planner/status.h"

namespace refit::ucx {

class RemoteKey {
 public:
  // Checks the framing (wire_blob.h), then ucp_ep_rkey_unpack. `what` names
  // the key in errors.
  static Result<RemoteKey> unpack(ucp_ep_h ep, std::span<const uint8_t> packed,
                                  const std::string& what);

  RemoteKey(RemoteKey&& other) noexcept;
  RemoteKey& operator=(RemoteKey&& other) noexcept;
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  ~RemoteKey();

  ucp_rkey_h get() const { return handle_; }
  uint64_t base() const { return base_; }
  uint64_t length() const { return length_; }
  bool contains(uint64_t address, uint64_t length) const {
    return address >= base_ && address - base_ <= length_ && length <= length_ - (address - base_);
  }

 private:
  RemoteKey(ucp_rkey_h h, uint64_t base, uint64_t length)
      : handle_(h), base_(base), length_(length) {}
  ucp_rkey_h handle_ = nullptr;
  uint64_t base_ = 0;
  uint64_t length_ = 0;
};

}  // namespace refit::ucx
