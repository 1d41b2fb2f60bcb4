#include "transport/ucx/memory.h"

#include <cstdio>

#include "transport/ucx/ucx_status.h"
#include "transport/ucx/wire_blob.h"

namespace refit::ucx {
namespace {

MemoryType from_ucs_memory_type(ucs_memory_type_t t) {
  switch (t) {
    case UCS_MEMORY_TYPE_HOST: return MemoryType::kHost;
    case UCS_MEMORY_TYPE_CUDA: return MemoryType::kCuda;
    case UCS_MEMORY_TYPE_CUDA_MANAGED: return MemoryType::kCudaManaged;
    case UCS_MEMORY_TYPE_ROCM: return MemoryType::kRocm;
    case UCS_MEMORY_TYPE_ROCM_MANAGED: return MemoryType::kRocmManaged;
    default: return MemoryType::kOther;
  }
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

}  // namespace

const char* memory_type_name(MemoryType type) {
  switch (type) {
    case MemoryType::kHost: return "host";
    case MemoryType::kCuda: return "cuda";
    case MemoryType::kCudaManaged: return "cuda-managed";
    case MemoryType::kRocm: return "rocm";
    case MemoryType::kRocmManaged: return "rocm-managed";
    case MemoryType::kOther: return "other";
  }
  return "other";
}

unsigned protection_flags(Access access) {
  unsigned flags = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ;
  if (access == Access::kRemoteReadWrite) flags |= UCP_MEM_MAP_PROT_REMOTE_WRITE;
  return flags;
}

std::string protection_names(unsigned flags) {
  std::string out;
  for (auto [bit, name] : {std::pair<unsigned, const char*>{UCP_MEM_MAP_PROT_LOCAL_READ, "LOCAL_READ"},
                           {UCP_MEM_MAP_PROT_LOCAL_WRITE, "LOCAL_WRITE"},
                           {UCP_MEM_MAP_PROT_REMOTE_READ, "REMOTE_READ"},
                           {UCP_MEM_MAP_PROT_REMOTE_WRITE, "REMOTE_WRITE"}}) {
    if (!(flags & bit)) continue;
    if (!out.empty()) out += "|";
    out += name;
  }
  return out.empty() ? "none" : out;
}

Result<MemoryRegion> MemoryRegion::map(const Context& context, void* address, size_t length,
                                       std::string name, Access access) {
  const std::string where = "ucx memory \"" + name + "\" at " + hex(address) + " (" +
                            std::to_string(length) + " bytes)";
  if (context.get() == nullptr) return Status::invalid(where + ": context is empty (moved from)");
  if (address == nullptr || length == 0) {
    return Status::invalid(where + ": a registered region needs a non-null address and a "
                           "positive length");
  }
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = length;
  return create(context, params, std::move(name), access, where);
}

Result<MemoryRegion> MemoryRegion::allocate(const Context& context, size_t length,
                                            std::string name, Access access) {
  const std::string where =
      "ucx memory \"" + name + "\" (" + std::to_string(length) + " bytes, allocated by UCX)";
  if (context.get() == nullptr) return Status::invalid(where + ": context is empty (moved from)");
  if (length == 0) return Status::invalid(where + ": a region needs a positive length");
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = length;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  return create(context, params, std::move(name), access, where);
}

Result<MemoryRegion> MemoryRegion::create(const Context& context,
                                          const ucp_mem_map_params_t& asked, std::string name,
                                          Access access, const std::string& where) {
  // UCX 1.13 takes the protection as given (ucp_mm.c reads the field and
  // hands it to each memory domain as UCT_MD_MEM_ACCESS_*); a domain whose
  // registration has no notion of it (tcp, shared memory) ignores it, which
  // is why AmRmaServer checks access() itself.
  ucp_mem_map_params_t params = asked;
  params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_PROT;
  params.prot = protection_flags(access);
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context.get(), &params, &memh);
  if (st != UCS_OK) {
    return from_ucs(st, where + ": ucp_mem_map with " + protection_names(params.prot));
  }

  MemoryRegion region;
  region.context_ = context.get();
  region.memh_ = memh;
  region.name_ = std::move(name);
  region.access_ = access;

  ucp_mem_attr_t attr = {};
  attr.field_mask =
      UCP_MEM_ATTR_FIELD_MEM_TYPE | UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) return from_ucs(st, where + ": ucp_mem_query");
  region.type_ = from_ucs_memory_type(attr.mem_type);
  // UCX may round an allocation up; the region is what was asked for.
  region.base_ = static_cast<uint8_t*>(params.address ? params.address : attr.address);
  region.length_ = params.length;

  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  st = ucp_rkey_pack(context.get(), memh, &rkey_buf, &rkey_len);
  if (st != UCS_OK) return from_ucs(st, where + ": ucp_rkey_pack");
  region.packed_rkey_ = frame_blob(
      BlobKind::kRemoteKey,
      std::span<const uint8_t>(static_cast<const uint8_t*>(rkey_buf), rkey_len),
      RemoteKeyHeader{reinterpret_cast<uint64_t>(region.base_), region.length_});
  ucp_rkey_buffer_release(rkey_buf);
  return region;
}

bool MemoryRegion::contains(const void* address, size_t length) const {
  auto a = reinterpret_cast<uintptr_t>(address);
  auto b = reinterpret_cast<uintptr_t>(base_);
  return a >= b && a - b <= length_ && length <= length_ - (a - b);
}

void MemoryRegion::release() {
  if (memh_) ucp_mem_unmap(context_, memh_);
  memh_ = nullptr;
}

MemoryRegion::MemoryRegion(MemoryRegion&& other) noexcept
    : context_(other.context_),
      memh_(other.memh_),
      base_(other.base_),
      length_(other.length_),
      type_(other.type_),
      access_(other.access_),
      name_(std::move(other.name_)),
      packed_rkey_(std::move(other.packed_rkey_)) {
  other.memh_ = nullptr;
}

MemoryRegion& MemoryRegion::operator=(MemoryRegion&& other) noexcept {
  if (this != &other) {
    release();
    context_ = other.context_;
    memh_ = other.memh_;
    base_ = other.base_;
    length_ = other.length_;
    type_ = other.type_;
    access_ = other.access_;
    name_ = std::move(other.name_);
    packed_rkey_ = std::move(other.packed_rkey_);
    other.memh_ = nullptr;
  }
  return *this;
}

MemoryRegion::~MemoryRegion() { release(); }

}  // namespace refit::ucx
