#pragma once
// The planner's model of who holds what. Everything is segments (docs/planner.md,
// "Layouts are segments"): a Region says "this box of tensor T lives at element `offset`
// of buffer B, with element `strides`, on every rank of a set". DTensor specs,
// fused framework parameters and explicit layout files all expand into
// Regions. Ranks that hold the same box at the same place share one Region
// through an interned rank set, which keeps a 90k-tensor, 256-rank layout
// small: the model never stores one entry per (rank, tensor) when a rank set
// will do.
//
// Thread safety: a Layout is built by one thread, then read-only; any number
// of threads may read a finished Layout.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "planner/box.h"
#include "planner/dtype.h"
#include "planner/status.h"

namespace refit {

enum class Side : uint8_t { kSource, kReceiver };
const char* side_name(Side s);  // "source" / "receiver"

using RankSetId = uint32_t;

// Interned, sorted, duplicate-free sets of ranks of one side.
class RankSets {
 public:
  // REQUIRES: `ranks` sorted ascending, no duplicates.
  RankSetId intern(const std::vector<int32_t>& ranks);
  const std::vector<int32_t>& get(RankSetId id) const { return sets_[id]; }
  size_t size() const { return sets_.size(); }

 private:
  struct Hash {
    size_t operator()(const std::vector<int32_t>& v) const;
  };
  std::vector<std::vector<int32_t>> sets_;
  std::unordered_map<std::vector<int32_t>, RankSetId, Hash> index_;
};

// A buffer of the same name and size on every rank of `ranks` (one side).
struct Buffer {
  Side side = Side::kSource;
  std::string name;
  DType dtype = DType::kBF16;
  int64_t bytes = 0;
  RankSetId ranks = 0;
};

struct Region {
  Box box;               // in the tensor's global index space
  RankSetId ranks = 0;   // the ranks that hold this box here (of the region's side)
  uint32_t buffer = 0;   // Layout::buffers[tensor.base(side) + buffer]
  int64_t offset = 0;    // element offset of box.start in the buffer
  Index strides{};       // element strides of each tensor dim in the buffer
};

// The regions of one tensor on one side. Copies share storage and a list is
// cloned on its first mutation while shared (copy on write), so tensors laid
// out alike (every expert of an FSDP layer: 256 shards each) hold one list.
// Iteration is read-only; mutate through push_back, operator[] or back().
class RegionList {
 public:
  RegionList() = default;
  RegionList(std::initializer_list<Region> regions)
      : p_(std::make_shared<std::vector<Region>>(regions)) {}
  explicit RegionList(std::vector<Region> regions)
      : p_(std::make_shared<std::vector<Region>>(std::move(regions))) {}

  size_t size() const { return p_ ? p_->size() : 0; }
  bool empty() const { return size() == 0; }
  const Region* begin() const { return p_ ? p_->data() : nullptr; }
  const Region* end() const { return p_ ? p_->data() + p_->size() : nullptr; }
  const Region& operator[](size_t i) const { return (*p_)[i]; }
  const Region& front() const { return p_->front(); }
  const Region& back() const { return p_->back(); }
  Region& operator[](size_t i) { return mut()[i]; }
  Region& back() { return mut().back(); }
  void push_back(const Region& r) { mut().push_back(r); }
  void reserve(size_t n) { mut().reserve(n); }
  void clear() { p_.reset(); }
  // Identity of the shared storage: equal for lists that share it.
  const void* id() const { return p_.get(); }

 private:
  std::vector<Region>& mut() {
    if (!p_) p_ = std::make_shared<std::vector<Region>>();
    else if (p_.use_count() > 1) p_ = std::make_shared<std::vector<Region>>(*p_);
    return *p_;
  }
  std::shared_ptr<std::vector<Region>> p_;
};

struct Tensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  RegionList sources;    // who can serve each part
  RegionList receivers;  // who needs each part, and where it goes
  // A region's buffer is Layout::buffers[base + region.buffer], base per side.
  // Bases are 0 unless the region list is shared with other tensors, whose
  // buffers then sit at the same relative positions after their own base.
  uint32_t source_base = 0;
  uint32_t receiver_base = 0;
  // The receivers' dtype when refit converts the tensor on the way
  // (planner/conversion.h, docs/conversion.md); unset: `dtype` on both sides.
  std::optional<DType> receiver_dtype;
  // A tensor the receivers compute instead of receiving: the block scales
  // (`W.weight_scale_inv`) of tensor `derived_from`, which is quantized to
  // F8_E4M3 on the way. It has no sources, and a plan has no units of it.
  // -1 for every other tensor.
  int64_t derived_from = -1;
  // Sources that serve the tensor already converted (the source config's
  // "quantize": "source", docs/conversion.md): of a tensor quantized to
  // F8_E4M3, F8_E4M3 copies of whole blocks; of its derived scale tensor,
  // those blocks' F32 scales. Their elements are the receivers' dtype and
  // their buffer indices absolute (Layout::buffers, no base). Set by the
  // layout file's source segments of the receivers' dtype, kept or dropped
  // by resolve_conversions; empty for every other tensor.
  RegionList converted_sources;
  std::optional<DType> converted_dtype;  // the dtype of converted_sources' elements
  int64_t bytes() const;
  DType dtype_on(Side s) const { return s == Side::kReceiver && receiver_dtype ? *receiver_dtype : dtype; }
  uint32_t base(Side s) const { return s == Side::kSource ? source_base : receiver_base; }
  uint32_t buffer_of(Side s, const Region& r) const { return base(s) + r.buffer; }
};

struct SourceRank {
  int32_t domain = 0;
};
struct ReceiverRank {
  int32_t domain = 0;
  int32_t instance = 0;
};

struct Layout {
  std::vector<SourceRank> sources;      // index == source rank
  std::vector<ReceiverRank> receivers;  // index == receiver rank
  std::vector<Tensor> tensors;
  std::vector<Buffer> buffers;
  RankSets source_sets;
  RankSets receiver_sets;
  // The F8_E4M3 quantization block over a tensor's last two dims (rows,
  // cols): the receivers' model's quantization_config.weight_block_size.
  // Used only by tensors quantized on the way (planner/conversion.h).
  std::array<int64_t, 2> weight_block_size{128, 128};

  RankSets& sets(Side s) { return s == Side::kSource ? source_sets : receiver_sets; }
  const RankSets& sets(Side s) const { return s == Side::kSource ? source_sets : receiver_sets; }
  RegionList& regions(uint32_t tensor, Side s) {
    return s == Side::kSource ? tensors[tensor].sources : tensors[tensor].receivers;
  }
  const RegionList& regions(uint32_t tensor, Side s) const {
    return s == Side::kSource ? tensors[tensor].sources : tensors[tensor].receivers;
  }
  int32_t num_ranks(Side s) const {
    return static_cast<int32_t>(s == Side::kSource ? sources.size() : receivers.size());
  }
  int32_t domain_of(Side s, int32_t rank) const {
    return s == Side::kSource ? sources[rank].domain : receivers[rank].domain;
  }
  // Index of the tensor named `name`, or -1. Linear the first time, then
  // through an index built on demand (not thread-safe while being built).
  int64_t find_tensor(const std::string& name) const;
  uint32_t add_buffer(Buffer b) {
    buffers.push_back(std::move(b));
    return static_cast<uint32_t>(buffers.size() - 1);
  }
  // Adds a tensor; REQUIRES a name not already present.
  uint32_t add_tensor(std::string name, DType dtype, std::vector<int64_t> shape);

 private:
  mutable std::unordered_map<std::string, uint32_t> tensor_index_;
};

// Row-major contiguous element strides of `shape`, padded with zeros.
Index row_major_strides(const std::vector<int64_t>& shape);

// Checks everything the planner relies on, and names the culprit on failure:
// ranks in range and domains/instances non-negative; every region's box
// non-empty and inside its tensor; its buffer of the region's side, held by
// every rank of the region; a derived tensor without sources; every element
// it maps inside the buffer; no two regions of one rank sharing a byte of a
// buffer. A buffer is bytes: a region's offset and strides count elements
// of its tensor's dtype on that side (Tensor::dtype_on), and one buffer may
// hold tensors of several dtypes; Buffer::dtype only says what its bytes
// must be a whole number of.
// Does not check that sources cover what receivers need: the planner does.
Status validate(const Layout& layout);

// One region's part of validate(): its box inside tensor `t`, its buffer of
// side `side` held by all its ranks, every element inside the buffer (elements
// of t.dtype_on(side), region.buffer counted from t.base(side)), no two
// elements at one place. The error names the tensor and the region.
Status check_region(const Layout& layout, const Tensor& t, const Region& region, Side side);

// The bytes [*lo, *hi) a region of elements of `elem_bytes` spans in its
// buffer, from its lowest to its highest element.
void byte_extent(const Region& r, int elem_bytes, int64_t* lo, int64_t* hi);

// Whether two regions of one buffer, of elements of a_bytes and b_bytes,
// share a byte. Enumerates both footprints: call it for regions whose
// extents meet.
bool regions_meet(const Region& a, int a_bytes, const Region& b, int b_bytes);

}  // namespace refit
