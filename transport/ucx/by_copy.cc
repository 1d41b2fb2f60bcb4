#include "transport/ucx/by_copy.h"

#include <cstdint>
#include <cstring>

namespace refit::ucx {
namespace {

// The state is the caller's CopySource (by_copy.h says why).
void* start_pack(void* /*context*/, const void* buffer, size_t /*count*/) { return const_cast<void*>(buffer); }

void* start_unpack(void* /*context*/, void* /*buffer*/, size_t /*count*/) { return nullptr; }

size_t packed_size(void* state) { return static_cast<const CopySource*>(state)->bytes; }

size_t pack(void* state, size_t offset, void* dest, size_t max_length) {
  const auto* s = static_cast<const CopySource*>(state);
  if (offset >= s->bytes) return 0;
  const size_t n = s->bytes - offset < max_length ? s->bytes - offset : max_length;
  std::memcpy(dest, static_cast<const uint8_t*>(s->data) + offset, n);
  return n;
}

ucs_status_t unpack(void* /*state*/, size_t /*offset*/, const void* /*src*/, size_t /*length*/) {
  return UCS_ERR_UNSUPPORTED;  // refit receives active messages as bytes, never into this type
}

void finish(void* /*state*/) {}  // the CopySource is the caller's

// The by-copy datatype, or 0 when UCX could not create it (no memory).
ucp_datatype_t create() {
  ucp_generic_dt_ops_t ops = {};
  ops.start_pack = &start_pack;
  ops.start_unpack = &start_unpack;
  ops.packed_size = &packed_size;
  ops.pack = &pack;
  ops.unpack = &unpack;
  ops.finish = &finish;
  ucp_datatype_t dt = 0;
  if (ucp_dt_create_generic(&ops, nullptr, &dt) != UCS_OK) return 0;
  return dt;  // lives as long as the process: UCX may still hold sends of it at exit
}

}  // namespace

const void* payload_buffer(ucp_request_param_t& param, bool by_copy, const CopySource* source) {
  static const ucp_datatype_t dt = create();
  if (!by_copy || source->bytes == 0 || dt == 0) return source->data;
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
  param.datatype = dt;
  return source;
}

}  // namespace refit::ucx
