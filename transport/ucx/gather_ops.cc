#include "transport/ucx/gather_ops.h"

namespace refit::ucx {

GatherOps make_gather_ops(std::span<const NetRunRef> runs, const GatherOptions& options) {
  GatherOps out;
  out.gathered.assign(runs.size(), false);
  // The grouper numbers the runs it is given; only eligible ones are given.
  std::vector<uint32_t> given;
  GatherGrouper grouper(
      options,
      [&](std::span<const uint64_t> members) {
        GatherOps::Op op;
        op.peer = runs[given[members.front()]].peer;
        for (uint64_t m : members) {
          const uint32_t i = given[m];
          op.parts.push_back(runs[i].part);
          op.runs.push_back(i);
          op.bytes += runs[i].part.bytes;
          out.gathered[i] = true;
        }
        out.gathered_runs += op.runs.size();
        out.ops.push_back(std::move(op));
      },
      [](uint64_t) {});
  for (uint32_t i = 0; i < runs.size(); ++i) {
    if (!runs[i].eligible) continue;
    given.push_back(i);
    grouper.add(GatherInput{0, runs[i].peer, static_cast<int64_t>(runs[i].part.bytes)});
  }
  grouper.finish();
  out.unpacked = grouper.unpacked();
  return out;
}

}  // namespace refit::ucx
