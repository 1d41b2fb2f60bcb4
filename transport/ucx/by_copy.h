#pragma once
// Active-message payloads that UCX sends by copy, never zero-copy.
//
// Why: UCX 1.13.1's tcp transport can complete a zero-copy active message
// twice when the endpoint fails under it (the peer was killed while refit's
// GET replies to it were in flight, and the reconnect to it was refused):
// the second completion trips an assertion (`comp->count > 0`, status
// "Endpoint timeout") and UCX aborts the process. A core of such an abort
// showed the completion of one of refit's own GET replies (am_rma.h). A
// payload described by a generic datatype has no zero-copy protocol: UCX
// packs it into its send buffers (buffer copy), and a failed endpoint then
// completes the send once, with an error. docs/refresh.md, "A peer's
// death inside UCX", says where it applies and what it costs.
//
// Zero-copy is taken off only where the context's transports are tcp or
// shared memory (ContextConfig::transports: tcp, shm, self): those are the
// endpoints that carry refit's own GETs (am_rma.h). A context that may
// reach RDMA transports keeps UCX's choice.

#include <ucp/api/ucp.h>

#include <cstddef>

namespace refit::ucx {

// The generic datatype whose elements are bytes, packed with memcpy from a
// contiguous buffer; created once per process. Falls back to contiguous
// bytes (UCX's default, zero-copy allowed) if UCX cannot create it.
ucp_datatype_t bytes_by_copy();

// Sets `param`'s datatype so that a send of `length` bytes goes by copy
// when `by_copy` holds (and the payload is not empty), else leaves UCX's
// contiguous default. The count UCX takes is then `length` either way.
void set_payload_datatype(ucp_request_param_t &param, bool by_copy,
                          size_t length);

} // namespace refit::ucx
