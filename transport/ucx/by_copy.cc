#include "transport/ucx/by_copy.h"

#include <cstdint>
#include <cstring>
#include <new>

namespace refit::ucx {
namespace {

struct PackState {
  const uint8_t* data;
  size_t bytes;
};

void* start_pack(void* /*context*/, const void* buffer, size_t count) {
  // No memory for the state: packed_size() and pack() then give 0 bytes,
  // and the receiver refuses the short message by its length.
  return new (std::nothrow) PackState{static_cast<const uint8_t*>(buffer), count};
}

void* start_unpack(void* /*context*/, void* /*buffer*/, size_t /*count*/) { return nullptr; }

size_t packed_size(void* state) { return state ? static_cast<PackState*>(state)->bytes : 0; }

size_t pack(void* state, size_t offset, void* dest, size_t max_length) {
  if (!state) return 0;
  const auto* s = static_cast<PackState*>(state);
  if (offset >= s->bytes) return 0;
  const size_t n = s->bytes - offset < max_length ? s->bytes - offset : max_length;
  std::memcpy(dest, s->data + offset, n);
  return n;
}

ucs_status_t unpack(void* /*state*/, size_t /*offset*/, const void* /*src*/, size_t /*length*/) {
  return UCS_ERR_UNSUPPORTED;  // refit receives active messages as bytes, never into this type
}

void finish(void* state) { delete static_cast<PackState*>(state); }

ucp_datatype_t create() {
  ucp_generic_dt_ops_t ops = {};
  ops.start_pack = &start_pack;
  ops.start_unpack = &start_unpack;
  ops.packed_size = &packed_size;
  ops.pack = &pack;
  ops.unpack = &unpack;
  ops.finish = &finish;
  ucp_datatype_t dt = 0;
  if (ucp_dt_create_generic(&ops, nullptr, &dt) != UCS_OK) return ucp_dt_make_contig(1);
  return dt;  // lives as long as the process: UCX may still hold sends of it at exit
}

}  // namespace

ucp_datatype_t bytes_by_copy() {
  static const ucp_datatype_t dt = create();
  return dt;
}

void set_payload_datatype(ucp_request_param_t& param, bool by_copy, size_t length) {
  if (!by_copy || length == 0) return;
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
  param.datatype = bytes_by_copy();
}

}  // namespace refit::ucx
