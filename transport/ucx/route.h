#pragma once
// Which network interface reaches a host: the default of an agent's
// "network.devices" (include/refit/refit.h), so that a worker listens only
// on the interface its coordinator is reached through and not on every
// interface of the host (docs/security.md, "Data plane").

#include <string>

#include "planner/status.h"

namespace refit::ucx {

// The name of the interface ("eth0", "lo") the kernel would send from to
// reach `host` (a name, an IPv4 or an IPv6 address), found without sending
// anything: a UDP socket connected to it, its local address, and the
// interface that holds that address. A wildcard address (0.0.0.0, ::) names
// no host and is an invalid-argument Status, as is a host that does not
// resolve or that no route reaches.
Result<std::string> interface_toward(const std::string& host);

}  // namespace refit::ucx
