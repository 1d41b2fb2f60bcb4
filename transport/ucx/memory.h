#pragma once
// A caller buffer registered with UCX once (ucp_mem_map), its memory type
// read back with ucp_mem_query, and its rkey packed once at registration.
// Move-only; must not outlive its Context. The caller keeps the buffer alive
// for as long as the region exists. Not thread-safe; immutable after
// create(), so const methods may be called from any thread.

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "planner/status.h"
#include "transport/ucx/context.h"

namespace refit::ucx {

enum class MemoryType { kHost, kCuda, kCudaManaged, kRocm, kRocmManaged, kOther };

const char* memory_type_name(MemoryType type);

// Whether the CPU can copy to and from memory of this type: host memory and
// managed memory. refit's own GETs, PUTs and gathers (am_rma.h) copy with
// the CPU at both ends; GPU memory needs a transport that reaches it.
inline bool cpu_can_copy(MemoryType type) {
  return type == MemoryType::kHost || type == MemoryType::kCudaManaged || type == MemoryType::kRocmManaged;
}

// What peers may do with a region. kRemoteRead maps it with
// UCP_MEM_MAP_PROT_LOCAL_READ | LOCAL_WRITE | REMOTE_READ: on a transport
// with RMA in hardware (rc, dc) the NIC refuses a peer's PUT into it, and
// refit's AmRmaServer refuses PUTs into it on the others (am_rma.h). A
// source's shards are mapped so (docs/security.md). kRemoteReadWrite adds
// REMOTE_WRITE: receivers' buffers that the local fabric PUTs into.
enum class Access { kRemoteRead, kRemoteReadWrite };

// The UCP_MEM_MAP_PROT_* flags `access` maps with, and their names joined
// by '|' ("LOCAL_READ|LOCAL_WRITE|REMOTE_READ"), for logs and reports.
unsigned protection_flags(Access access);
std::string protection_names(unsigned flags);

class MemoryRegion {
 public:
  // Registers [address, address + length). Zero length or a null address is
  // an invalid-argument Status naming `name`.
  static Result<MemoryRegion> map(const Context& context, void* address, size_t length,
                                  std::string name = "buffer",
                                  Access access = Access::kRemoteReadWrite);
  // Allocates `length` bytes through UCX (UCP_MEM_MAP_ALLOCATE) and registers
  // them; the region owns the memory and frees it. On a shared-memory
  // context UCX allocates it as a posix/sysv segment, which peers on the
  // same host map and GET from with a plain memcpy (what ucx_perftest
  // measures). For memory from map() UCX 1.13 has no shared-memory RMA
  // lane (cma only serves rendezvous), so it emulates GETs with active
  // messages, several times slower (refit-ucx-bench --memory user).
  // Contents start undefined.
  static Result<MemoryRegion> allocate(const Context& context, size_t length,
                                       std::string name = "buffer",
                                       Access access = Access::kRemoteReadWrite);

  MemoryRegion(MemoryRegion&& other) noexcept;
  MemoryRegion& operator=(MemoryRegion&& other) noexcept;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ~MemoryRegion();

  ucp_mem_h get() const { return memh_; }
  uint8_t* base() const { return base_; }
  size_t length() const { return length_; }
  MemoryType type() const { return type_; }
  const std::string& name() const { return name_; }
  Access access() const { return access_; }
  // The UCP_MEM_MAP_PROT_* flags the region was mapped with.
  unsigned protection() const { return protection_flags(access_); }
  bool contains(const void* address, size_t length) const;

  // The rkey for peers, packed once at map(): opaque framed bytes that also
  // carry the region's base and length (see wire_blob.h).
  const std::vector<uint8_t>& packed_rkey() const { return packed_rkey_; }

 private:
  MemoryRegion() = default;
  static Result<MemoryRegion> create(const Context& context, const ucp_mem_map_params_t& params,
                                     std::string name, Access access, const std::string& where);
  void release();
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  uint8_t* base_ = nullptr;
  size_t length_ = 0;
  MemoryType type_ = MemoryType::kHost;
  Access access_ = Access::kRemoteReadWrite;
  std::string name_;
  std::vector<uint8_t> packed_rkey_;
};

}  // namespace refit::ucx
