#include "transport/ucx/remote_key.h"

#include "transport/ucx/ucx_status.h"
#include "transport/ucx/wire_blob.h"

namespace refit::ucx {

Result<RemoteKey> RemoteKey::unpack(ucp_ep_h ep, std::span<const uint8_t> packed,
                                    const std::string& what) {
  auto blob = unframe_blob(BlobKind::kRemoteKey, packed, what);
  if (!blob) return blob.status();
  if (blob->payload.empty() || blob->region.length == 0) {
    return Status::invalid(what + ": the key opens no memory (empty payload or region)");
  }
  ucp_rkey_h handle = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep, blob->payload.data(), &handle);
  if (st != UCS_OK) return from_ucs(st, what + ": ucp_ep_rkey_unpack");
  return RemoteKey(handle, blob->region.base, blob->region.length);
}

RemoteKey::RemoteKey(RemoteKey&& other) noexcept
    : handle_(other.handle_), base_(other.base_), length_(other.length_) {
  other.handle_ = nullptr;
}

RemoteKey& RemoteKey::operator=(RemoteKey&& other) noexcept {
  if (this != &other) {
    if (handle_) ucp_rkey_destroy(handle_);
    handle_ = other.handle_;
    base_ = other.base_;
    length_ = other.length_;
    other.handle_ = nullptr;
  }
  return *this;
}

RemoteKey::~RemoteKey() {
  if (handle_) ucp_rkey_destroy(handle_);
}

}  // namespace refit::ucx
