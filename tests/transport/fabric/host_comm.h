#pragma once
// A communicator among threads of one process, with NCCL's semantics where
// the NCCL fabric depends on them: each rank's operations run one after
// another in issue order (a group starts only once everything issued before
// it has finished), the n-th send from a to b meets the n-th receive at b
// from a, a group finishes when all of its operations have, a unique id
// serves one communicator, a rank that never joins or that aborted leaves
// its peers waiting (only their deadline ends it). Unlike NCCL, sizes that
// disagree are an error at both ends rather than undefined.
//
// Progress is made by whichever rank calls idle() or issue(); all state is
// under one mutex of the world the ranks share. It can scatter (the packed
// fan-out): pack areas are host memory, a scatter a memcpy per piece in
// stream order, each piece checked first (into the send area or out of the
// receive area, no two writing the same bytes, no more than pack_areas()
// was sized for: a status otherwise); HostCommFactory(false) makes a
// factory that cannot.

#include <map>
#include <memory>
#include <mutex>

#include "transport/cuda/device_ops.h"

namespace refit::cuda::testing {

class HostCommFactory final : public CommFactory {
 public:
  explicit HostCommFactory(bool can_scatter = true) : can_scatter_(can_scatter) {}
  bool can_scatter() const override { return can_scatter_; }
  Result<std::vector<uint8_t>> unique_id() override;
  Result<std::unique_ptr<DomainComm>> connect(const std::vector<uint8_t>& id, int32_t size, int32_t rank,
                                              Clock::time_point deadline) override;
  // Communicators this factory has connected.
  int connects() const { return connects_; }

 private:
  int connects_ = 0;
  bool can_scatter_;
};

}  // namespace refit::cuda::testing
