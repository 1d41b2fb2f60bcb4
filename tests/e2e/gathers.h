#pragma once
// What the receivers' reports say about gathers (docs/refresh.md,
// "Gathers"): the e2e suites check that small runs really travelled
// grouped on each refresh path, not only that the bytes arrived.

#include <cstdint>

#include "tools/bench/refresh_run.h"

namespace refit::e2e {

// The runs the receivers of one version carried in gathers, summed over
// their reports ("gathers": {"runs"}); 0 when no report has gathers.
inline int64_t gathered_runs(const bench::VersionResult& v) {
  int64_t runs = 0;
  for (const auto& report : v.reports) {
    auto g = report.find("gathers");
    if (g != report.end() && g->is_object()) runs += g->value("runs", int64_t{0});
  }
  return runs;
}

}  // namespace refit::e2e
