#include "transport/fabric/round_words.h"

#include <string>

namespace refit::fabric {

size_t ranges_prefix(std::span<const uint32_t> positions) {
  size_t ranges = 0;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (i == 0 || positions[i] != positions[i - 1] + 1) {
      if (ranges == kMaxRanges) return i;
      ++ranges;
    }
  }
  return positions.size();
}

void write_announcement(uint64_t* w, uint64_t bytes, uint64_t digest, std::span<const uint32_t> positions) {
  w[0] = positions.size();
  w[1] = bytes;
  w[2] = digest;
  uint64_t ranges = 0;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (i > 0 && positions[i] == positions[i - 1] + 1) {
      ++w[5 + 2 * (ranges - 1)];
      continue;
    }
    w[4 + 2 * ranges] = positions[i];
    w[5 + 2 * ranges] = 1;
    ++ranges;
  }
  w[3] = ranges;
  for (size_t k = 4 + 2 * ranges; k < kRoundWordsPerPeer; ++k) w[k] = 0;
}

Status read_positions(const uint64_t* w, size_t size, std::vector<uint8_t>& got, std::vector<uint32_t>* positions) {
  positions->clear();
  const uint64_t count = w[0];
  const uint64_t ranges = w[3];
  if (ranges > kMaxRanges) {
    return Status::invalid(std::to_string(ranges) + " ranges of slices announced, a round holds at most " +
                           std::to_string(kMaxRanges));
  }
  if (count > size) {
    return Status::invalid(std::to_string(count) + " slices announced, this rank's plan has " +
                           std::to_string(size) + " from it");
  }
  Status bad;
  for (uint64_t i = 0; i < ranges && bad.is_ok(); ++i) {
    const uint64_t start = w[4 + 2 * i];
    const uint64_t length = w[5 + 2 * i];
    if (length == 0 || start >= size || length > size - start) {
      bad = Status::invalid("range " + std::to_string(i) + " (slices " + std::to_string(start) + ", " +
                            std::to_string(length) + " of them) is empty or outside this rank's " +
                            std::to_string(size) + " slices from it");
      break;
    }
    if (positions->size() + length > count) {
      bad = Status::invalid("its ranges name more slices than the " + std::to_string(count) + " announced");
      break;
    }
    for (uint64_t k = start; k < start + length; ++k) {
      if (got[k]) {
        bad = Status::invalid("slice " + std::to_string(k) + " announced again: it was received before, or " +
                              "named twice in one round");
        break;
      }
      got[k] = 1;
      positions->push_back(static_cast<uint32_t>(k));
    }
  }
  if (bad.is_ok() && positions->size() != count) {
    bad = Status::invalid(std::to_string(count) + " slices announced, its ranges name " +
                          std::to_string(positions->size()));
  }
  if (!bad.is_ok()) {
    for (uint32_t k : *positions) got[k] = 0;
    positions->clear();
  }
  return bad;
}

}  // namespace refit::fabric
