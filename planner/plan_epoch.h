#pragma once
// Which plan a receiver executes: the membership epoch the coordinator
// planned (it grows by one whenever a member joins, leaves or dies) and
// whether the part is of the coordinator's solo plan, where the receiver
// pulls everything itself (docs/refresh.md, "Retries"). Every rank of a
// domain must run the same one; a solo attempt and the domain's attempt of
// one membership are different plans.
//
// On the wire (fetch_plan's "epoch") one integer: the counter, with the solo
// flag in bit 32 (kWireSoloBit). The local fabrics' flags pack it their own
// way (transport/fabric/mailbox.h), each converting from this struct.

#include <cstdint>

namespace refit {

struct PlanEpoch {
  static constexpr uint64_t kWireSoloBit = uint64_t{1} << 32;

  uint64_t counter = 0;  // the membership epoch; 0: no plan
  bool solo = false;

  uint64_t wire() const { return counter | (solo ? kWireSoloBit : 0); }
  static PlanEpoch from_wire(uint64_t word) { return PlanEpoch{word & ~kWireSoloBit, (word & kWireSoloBit) != 0}; }
  bool none() const { return counter == 0 && !solo; }
  bool operator==(const PlanEpoch&) const = default;
};

}  // namespace refit
