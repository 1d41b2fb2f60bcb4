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
// shared memory (Context::am_by_copy): those are the endpoints that carry
// refit's own GETs (am_rma.h). A context that may reach RDMA transports
// keeps UCX's choice.
//
// UCX does not call the datatype's finish() for a send it completes with an
// error (seen with 1.13.1: a peer killed with sends pending), so the pack
// state is no allocation: it is the CopySource the caller keeps until the
// send's callback, which UCX calls for every send, failed or not.

#include <ucp/api/ucp.h>

#include <cstddef>

namespace refit::ucx {

// The bytes of one send. Must stay where it is, and its bytes valid, until
// the send completes (its callback ran, or ucp_am_send_nbx returned no
// request).
struct CopySource {
  const void* data = nullptr;
  size_t bytes = 0;
};

// Sets `param`'s datatype for a send of `source` and returns the buffer to
// hand ucp_am_send_nbx with `source->bytes` as the count: `source` itself
// with the by-copy datatype (a generic datatype whose buffer is a
// CopySource, packed with memcpy, created once per process) when `by_copy`
// holds and the payload is not empty, else `source->data` with UCX's
// contiguous default. Without memory to create the datatype, the default.
const void* payload_buffer(ucp_request_param_t& param, bool by_copy, const CopySource* source);

}  // namespace refit::ucx
