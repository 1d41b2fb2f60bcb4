// Property tests of the planner against a brute-force reference that works
// element by element: its verdict on bytes owes nothing to the planner's
// cells, units or pieces.
//
// A seeded generator (std::mt19937_64, fixed seeds) builds small random
// layouts: DTensor specs on both sides (R, S(d), nested S(d), SS(d,k) paired
// with a later S(d)), replicas, tensors nobody receives, receivers that need
// only part of a tensor, and hand-built composite buffers (a qkv-like cat of
// row slices of three tensors, gaps between segments, transposed, padded,
// reversed and interleaved strides). Every buffer of every rank is simulated
// as an array of byte tags: a source byte's tag names (tensor, global
// element, byte of element), exactly, where a hashed byte pattern could
// collide; a receiver byte starts as a sentinel. The runs of for_each_run()
// are executed in order as copies of tags, and the result is compared with
// what the layout says, byte by byte (docs/planner.md, "What a plan
// guarantees"; docs/formats.md, "Runs export").
//
// The sweep over all random layouts runs once (the first test that needs it
// runs it) and records violations per property; each PlanProperty test of
// the sweep asserts one property, so a failure names the behaviour that broke
// and shows the first offending layout with its seed. The tests after it
// cover a missing source, load balance with replicated sources,
// for_each_copy, and DTensor expansion against its own brute force.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "planner/box.h"
#include "planner/dtype.h"
#include "planner/layout.h"
#include "planner/placement.h"
#include "planner/plan.h"
#include "planner/recipes/recipe.h"
#include "tests/planner/element_walk.h"

namespace refit {
namespace {

using refit::reference::element_offset;
using refit::reference::for_each_element;
using refit::reference::linear_index;

// ---------------------------------------------------------------------------
// Element-level helpers, independent of the planner.

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

bool in_set(const std::vector<int32_t>& set, int32_t x) { return std::binary_search(set.begin(), set.end(), x); }

// A byte tag: which byte of which element of which tensor a byte holds.
constexpr uint64_t kSentinel = 0;  // a receiver byte no run has written
constexpr uint64_t kJunk = 1;      // a source byte outside every source region
uint64_t byte_tag(uint32_t t, int64_t g, int k) {
  return ((uint64_t{t} + 1) << 40) | (static_cast<uint64_t>(g) << 3) | static_cast<uint64_t>(k);
}
uint32_t tag_tensor(uint64_t tag) { return static_cast<uint32_t>((tag >> 40) - 1); }
int64_t tag_element(uint64_t tag) { return static_cast<int64_t>((tag >> 3) & ((uint64_t{1} << 37) - 1)); }
int tag_byte(uint64_t tag) { return static_cast<int>(tag & 7); }

std::string ranks_str(const std::vector<int32_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

std::string strides_str(const Index& s, int nd) {
  std::string o = "[";
  for (int d = 0; d < nd; ++d) o += (d ? "," : "") + std::to_string(s[d]);
  return o + "]";
}

// The whole layout, for failure messages.
std::string describe(const Layout& L) {
  std::ostringstream os;
  os << "sources:";
  for (size_t i = 0; i < L.sources.size(); ++i) os << " " << i << "@d" << L.sources[i].domain;
  os << "\nreceivers:";
  for (size_t i = 0; i < L.receivers.size(); ++i)
    os << " " << i << "@d" << L.receivers[i].domain << "/i" << L.receivers[i].instance;
  os << "\n";
  for (const Tensor& t : L.tensors) {
    os << "tensor \"" << t.name << "\" " << dtype_name(t.dtype) << " " << Box::whole(t.shape).to_string() << "\n";
    for (Side side : {Side::kSource, Side::kReceiver}) {
      const auto& regions = side == Side::kSource ? t.sources : t.receivers;
      for (size_t i = 0; i < regions.size(); ++i) {
        const Region& r = regions[i];
        os << "  " << side_name(side) << "[" << i << "] " << r.box.to_string() << " ranks "
           << ranks_str(L.sets(side).get(r.ranks)) << " buf#" << r.buffer << " \"" << L.buffers[r.buffer].name
           << "\" off " << r.offset << " strides " << strides_str(r.strides, r.box.ndim) << "\n";
      }
    }
  }
  for (size_t i = 0; i < L.buffers.size(); ++i) {
    const Buffer& b = L.buffers[i];
    os << "buf#" << i << " " << side_name(b.side) << " \"" << b.name << "\" " << b.bytes << " bytes ranks "
       << ranks_str(L.sets(b.side).get(b.ranks)) << "\n";
  }
  return os.str();
}

std::string run_str(const Run& r) {
  std::ostringstream os;
  os << (r.local ? "local" : "net") << " from " << side_name(r.from.side) << " " << r.from.rank << " buf#"
     << r.from.buffer << "@" << r.from.offset << " to " << side_name(r.to.side) << " " << r.to.rank << " buf#"
     << r.to.buffer << "@" << r.to.offset << " " << r.bytes << " bytes";
  return os.str();
}

bool same_run(const Run& a, const Run& b) {
  auto same_end = [](const RunEnd& x, const RunEnd& y) {
    return x.side == y.side && x.rank == y.rank && x.buffer == y.buffer && x.offset == y.offset;
  };
  return a.local == b.local && same_end(a.from, b.from) && same_end(a.to, b.to) && a.bytes == b.bytes;
}

std::vector<Run> collect_runs(const Plan& plan) {
  std::vector<Run> runs;
  for_each_run(plan, [&](const Run& r) { runs.push_back(r); });
  return runs;
}

// ---------------------------------------------------------------------------
// DTensor reference: PyTorch's _explicit_order_placements written out again
// from its definition, plus refit's stricter rule that a strided shard with
// no later plain shard to pair with is an error. Returns the sharding order
// as (mesh dim, tensor dim) steps, or nullopt for a spec refit must refuse.

std::optional<std::vector<std::pair<int, int>>> reference_order(const std::vector<int64_t>& mesh,
                                                                const std::vector<Placement>& ps, int ndim) {
  if (ps.size() != mesh.size() || mesh.empty()) return std::nullopt;
  std::vector<std::pair<int, int>> order;
  std::map<int, std::vector<int>> deferred;
  std::vector<bool> ended(ndim, false);
  for (int m = 0; m < static_cast<int>(ps.size()); ++m) {
    const Placement& p = ps[m];
    if (p.kind == Placement::Kind::kReplicate) continue;
    if (p.dim < 0 || p.dim >= ndim) return std::nullopt;
    if (p.kind == Placement::Kind::kStridedShard) {
      deferred[p.dim].push_back(m);
      continue;
    }
    if (ended[p.dim]) return std::nullopt;
    order.push_back({m, p.dim});
    if (auto it = deferred.find(p.dim); it != deferred.end()) {
      ended[p.dim] = true;
      int64_t aggregate = mesh[m];
      std::vector<int> pending = it->second;
      deferred.erase(it);
      while (!pending.empty()) {
        const int sm = pending.back();
        pending.pop_back();
        if (ps[sm].split_factor != aggregate) return std::nullopt;
        aggregate *= mesh[sm];
        order.push_back({sm, p.dim});
      }
    }
  }
  if (!deferred.empty()) return std::nullopt;
  return order;
}

// Does the rank at mesh coordinate `coord` own element `x` of tensor dim `d`
// (of size n)? Applies the steps of `order` that cut dim d, one after another,
// with torch.chunk semantics, on the interval the earlier steps left.
bool owns_along(const std::vector<int64_t>& mesh, const std::vector<std::pair<int, int>>& order,
                const std::vector<int64_t>& coord, int d, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  for (const auto& [m, dim] : order) {
    if (dim != d) continue;
    const int64_t len = hi - lo;
    const int64_t chunk = (len + mesh[m] - 1) / mesh[m];
    const int64_t s = std::min(lo + coord[m] * chunk, hi);
    const int64_t e = std::min(s + chunk, hi);
    if (x < s || x >= e) return false;
    lo = s;
    hi = e;
  }
  return true;
}

// ---------------------------------------------------------------------------
// The random layout generator.

struct Rng {
  explicit Rng(uint64_t seed) : g(seed) {}
  int uni(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); }
  bool coin(double p) { return std::bernoulli_distribution(p)(g); }
  std::mt19937_64 g;
};

std::vector<int64_t> random_shape(Rng& r, int max_dims, int64_t max_numel) {
  const int nd = r.uni(1, max_dims);
  std::vector<int64_t> s(nd);
  for (auto& x : s) x = r.coin(0.3) ? r.uni(1, 3) : r.uni(1, 13);
  while (numel_of(s) > max_numel) {
    int64_t& x = s[r.uni(0, nd - 1)];
    x = (x + 1) / 2;
  }
  return s;
}

// Mostly random_shape(4 dims); now and then a scalar (an FP8 per-tensor
// scale) or a tensor of 5-8 small dims.
std::vector<int64_t> random_shape_any(Rng& r, int64_t max_numel) {
  const int c = r.uni(0, 39);
  if (c == 0) return {};
  if (c == 1) {
    std::vector<int64_t> s(r.uni(5, kMaxDims));
    for (auto& x : s) x = r.uni(1, 2);
    return s;
  }
  return random_shape(r, 4, max_numel);
}

// A mesh of 1-3 dims (sizes 1 allowed) whose product is n.
std::vector<int64_t> random_mesh(Rng& r, int64_t n) {
  std::vector<int64_t> mesh(r.uni(1, 3), 1);
  int64_t x = n;
  for (int64_t p = 2; x > 1;) {
    if (x % p == 0) {
      mesh[r.uni(0, static_cast<int>(mesh.size()) - 1)] *= p;
      x /= p;
    } else {
      ++p;
    }
  }
  return mesh;
}

// Random placements. Strided shards get the split factor their pairing
// requires; with `valid_only`, unpaired strided shards become R and a spec the
// reference refuses is drawn again; otherwise split factors are sometimes
// wrong and strided shards sometimes unpaired, to test the refusals.
std::vector<Placement> random_placements(Rng& r, const std::vector<int64_t>& mesh, int ndim, bool valid_only) {
  for (int attempt = 0;; ++attempt) {
    std::vector<Placement> ps(mesh.size());
    for (auto& p : ps) {
      const int c = attempt > 20 ? r.uni(0, 7) : r.uni(0, 9);
      if (c < 3 || ndim == 0) {
        p.kind = Placement::Kind::kReplicate;
      } else if (c < 8) {
        p.kind = Placement::Kind::kShard;
        p.dim = r.uni(0, ndim - 1);
      } else {
        p.kind = Placement::Kind::kStridedShard;
        p.dim = r.uni(0, ndim - 1);
      }
    }
    // Give strided shards the split factor their pairing needs.
    std::map<int, std::vector<int>> pending;
    for (int m = 0; m < static_cast<int>(ps.size()); ++m) {
      if (ps[m].kind == Placement::Kind::kStridedShard) pending[ps[m].dim].push_back(m);
      if (ps[m].kind != Placement::Kind::kShard) continue;
      auto it = pending.find(ps[m].dim);
      if (it == pending.end()) continue;
      int64_t aggregate = mesh[m];
      for (auto k = it->second.rbegin(); k != it->second.rend(); ++k) {
        ps[*k].split_factor = static_cast<int>(aggregate);
        aggregate *= mesh[*k];
      }
      pending.erase(it);
    }
    if (valid_only) {
      for (auto& [dim, ms] : pending)
        for (int m : ms) ps[m] = Placement{};
      if (reference_order(mesh, ps, ndim)) return ps;
      continue;
    }
    if (r.coin(0.15)) {
      for (auto& p : ps)
        if (p.kind == Placement::Kind::kStridedShard && r.coin(0.5)) p.split_factor += 1;
    }
    return ps;
  }
}

// Element strides for a segment of `box` in a buffer: row-major, a random
// permutation of dims (a transpose), or row-major with padding between rows
// (and sometimes between elements). *extent is the span in elements.
Index random_strides(Rng& r, const Box& box, int64_t* extent) {
  const int nd = box.ndim;
  const int kind = r.uni(0, 2);
  std::vector<int> order(nd);  // order[0] is outermost in memory
  std::iota(order.begin(), order.end(), 0);
  if (kind == 1) std::shuffle(order.begin(), order.end(), r.g);
  Index s{};
  int64_t acc = (kind == 2 && r.coin(0.3)) ? 2 : 1;
  for (int i = nd - 1; i >= 0; --i) {
    const int d = order[i];
    s[d] = acc;
    acc = acc * box.size[d] + (kind == 2 ? r.uni(0, 2) : 0);
  }
  *extent = 1;
  for (int d = 0; d < nd; ++d) *extent += (box.size[d] - 1) * s[d];
  return s;
}

Box random_sub_box(Rng& r, const std::vector<int64_t>& shape) {
  Box b;
  b.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < b.ndim; ++d) {
    b.start[d] = r.uni(0, static_cast<int>(shape[d]) - 1);
    b.size[d] = r.uni(1, static_cast<int>(shape[d] - b.start[d]));
  }
  return b;
}

// torch.chunk(n, k)[i] as [lo, hi).
std::pair<int64_t, int64_t> torch_chunk(int64_t n, int64_t k, int64_t i) {
  const int64_t c = (n + k - 1) / k;
  const int64_t lo = std::min(i * c, n);
  return {lo, std::min(lo + c, n)};
}

struct Segment {
  uint32_t tensor;
  Box box;
};

class LayoutGen {
 public:
  explicit LayoutGen(uint64_t seed) : r_(seed) {}

  // A random layout; sources cover every tensor (each tensor's main source
  // spec is a DTensor, whose shards cover it).
  Layout make() {
    Layout L;
    const int nsrc = r_.uni(1, 6);
    const int sdoms = r_.uni(1, 2);
    for (int i = 0; i < nsrc; ++i) L.sources.push_back({r_.uni(0, sdoms - 1)});
    const int nrcv = r_.uni(1, 8);
    const int ndom = r_.uni(1, 3);
    const int isz = r_.uni(1, nrcv);
    const int dom_mode = r_.uni(0, 2);
    for (int i = 0; i < nrcv; ++i) {
      const int inst = i / isz;
      const int dom = dom_mode == 0 ? i * ndom / nrcv : dom_mode == 1 ? r_.uni(0, ndom - 1) : inst % ndom;
      L.receivers.push_back({dom, inst});
    }
    const int nt = r_.uni(1, 4);
    for (int i = 0; i < nt; ++i) add_plain_tensor(L, "t" + std::to_string(i), isz);
    if (r_.coin(0.3)) add_qkv(L, isz);
    if (r_.coin(0.25)) add_composite(L, Side::kSource, "arena");
    const int ncomp = r_.coin(0.5) ? r_.uni(1, 2) : 0;
    for (int i = 0; i < ncomp; ++i) add_composite(L, Side::kReceiver, "fused" + std::to_string(i));
    return L;
  }

  Rng& rng() { return r_; }
  std::map<std::string, int64_t> features;  // what the layouts exercised

 private:
  DType random_dtype() {
    static const DType kTypes[] = {DType::kU8,  DType::kI8,  DType::kF8E4M3, DType::kBF16, DType::kF16,
                                   DType::kI16, DType::kF32, DType::kI32,    DType::kF64};
    const int i = r_.uni(0, 8);
    return kTypes[i == 8 && r_.coin(0.7) ? r_.uni(0, 7) : i];  // 8-byte elements only now and then
  }

  std::vector<int32_t> shuffled(int n) {
    std::vector<int32_t> v(n);
    std::iota(v.begin(), v.end(), 0);
    std::shuffle(v.begin(), v.end(), r_.g);
    return v;
  }

  // A DTensor spec over `ranks` (row-major mesh order) with random placements
  // (or the given ones). Returns the spec used.
  DTensorSpec add_spec(Layout& L, uint32_t t, Side side, const std::vector<int32_t>& ranks, const std::string& name,
                       const std::vector<Placement>* fixed = nullptr,
                       const std::vector<int64_t>* fixed_mesh = nullptr) {
    DTensorSpec spec;
    spec.mesh = fixed_mesh ? *fixed_mesh : random_mesh(r_, static_cast<int64_t>(ranks.size()));
    spec.ranks = ranks;
    spec.placements =
        fixed ? *fixed : random_placements(r_, spec.mesh, static_cast<int>(L.tensors[t].shape.size()), true);
    add_spec(L, t, side, spec, name);
    return spec;
  }

  void add_spec(Layout& L, uint32_t t, Side side, const DTensorSpec& spec, const std::string& name) {
    const size_t before = L.regions(t, side).size();
    const Status st = add_dtensor(L, t, side, spec, name);
    if (!st.is_ok()) {
      ADD_FAILURE() << "generator: add_dtensor refused a valid spec: " << st.message();
      return;
    }
    // What the spec exercised, for the sweep's report.
    std::vector<int> shards_of_dim(L.tensors[t].shape.size(), 0);
    for (const Placement& p : spec.placements) {
      if (p.kind == Placement::Kind::kStridedShard) ++features["spec with SS(d,k)"];
      if (p.kind != Placement::Kind::kReplicate) ++shards_of_dim[p.dim];
    }
    for (int n : shards_of_dim)
      if (n > 1) ++features["spec with nested shards of one dim"];
    size_t holders = 0;
    for (size_t i = before; i < L.regions(t, side).size(); ++i) {
      const size_t n = L.sets(side).get(L.regions(t, side)[i].ranks).size();
      holders += n;
      if (n > 1) ++features[std::string(side_name(side)) + " box replicated on several ranks"];
    }
    if (holders < spec.ranks.size()) ++features["spec with empty trailing shards"];
  }

  // A tensor with DTensor sources and random receivers. A twin has the shape
  // and source specs of an earlier tensor and another dtype (weights and
  // their scales): the planner may share work between such tensors, but not
  // their element size.
  struct SourceSpecs {
    std::vector<int64_t> shape;
    std::vector<DTensorSpec> specs;
  };
  void add_plain_tensor(Layout& L, const std::string& name, int isz, const SourceSpecs* twin = nullptr) {
    DType dt = random_dtype();
    if (twin)
      while (dt == L.tensors.back().dtype) dt = random_dtype();
    const uint32_t t = L.add_tensor(name, dt, twin ? twin->shape : random_shape_any(r_, 600));
    if (L.tensors[t].shape.size() == 0) ++features["scalar tensor"];
    if (L.tensors[t].shape.size() > 4) ++features["tensor of 5-8 dims"];
    const int nsrc = L.num_ranks(Side::kSource);
    // Sources: one spec over a random subset (it covers the tensor), and
    // sometimes a second one over another subset: a replica.
    SourceSpecs mine{L.tensors[t].shape, {}};
    if (twin) {
      ++features["twin tensor (same sources, other dtype)"];
      for (size_t i = 0; i < twin->specs.size(); ++i)
        add_spec(L, t, Side::kSource, twin->specs[i], name + (i ? "#replica" : ""));
    } else {
      auto ranks = shuffled(nsrc);
      ranks.resize(r_.uni(1, nsrc));
      mine.specs.push_back(add_spec(L, t, Side::kSource, ranks, name));
      if (r_.coin(0.3)) {
        ++features["tensor with a second source spec"];
        ranks = shuffled(nsrc);
        ranks.resize(r_.uni(1, nsrc));
        mine.specs.push_back(add_spec(L, t, Side::kSource, ranks, name + "#replica"));
      }
    }
    add_receivers(L, t, name, isz);
    if (!twin && r_.coin(0.15)) add_plain_tensor(L, name + "'", isz, &mine);
  }

  void add_receivers(Layout& L, uint32_t t, const std::string& name, int isz) {
    const int nrcv = L.num_ranks(Side::kReceiver);
    const int mode = r_.uni(0, 19);
    if (mode < 3) {
      ++features["tensor nobody receives (unless a fused buffer does)"];
      return;
    }
    if (mode < 12) {
      // vLLM-like: every instance (some skipped) holds the same spec over its ranks.
      const int ninst = (nrcv + isz - 1) / isz;
      std::map<int, std::pair<std::vector<int64_t>, std::vector<Placement>>> by_size;
      for (int inst = 0; inst < ninst; ++inst) {
        if (ninst > 1 && r_.coin(0.2)) continue;
        std::vector<int32_t> ranks;
        for (int x = inst * isz; x < std::min(nrcv, (inst + 1) * isz); ++x) ranks.push_back(x);
        auto it = by_size.find(static_cast<int>(ranks.size()));
        if (it == by_size.end()) {
          auto mesh = random_mesh(r_, static_cast<int64_t>(ranks.size()));
          auto ps = random_placements(r_, mesh, static_cast<int>(L.tensors[t].shape.size()), true);
          it = by_size.emplace(static_cast<int>(ranks.size()), std::make_pair(mesh, ps)).first;
        }
        add_spec(L, t, Side::kReceiver, ranks, name, &it->second.second, &it->second.first);
      }
      return;
    }
    if (mode < 17) {
      auto ranks = shuffled(nrcv);
      ranks.resize(r_.uni(1, nrcv));
      add_spec(L, t, Side::kReceiver, ranks, name);
      if (r_.coin(0.2)) {  // the same tensor again, on ranks that may already have it
        ++features["tensor received twice by one spec each"];
        auto more = shuffled(nrcv);
        more.resize(r_.uni(1, nrcv));
        add_spec(L, t, Side::kReceiver, more, name + "#again");
      }
      return;
    }
    // Explicit: a few ranks each need a part of the tensor, in their own buffer.
    ++features["tensor needed only in parts (explicit segments)"];
    const int n = r_.uni(1, 3);
    for (int i = 0; i < n; ++i) {
      auto ranks = shuffled(nrcv);
      ranks.resize(r_.uni(1, std::min(3, nrcv)));
      std::sort(ranks.begin(), ranks.end());
      const RankSetId set = L.receiver_sets.intern(ranks);
      const uint32_t bi =
          L.add_buffer({Side::kReceiver, name + "#part" + std::to_string(i), L.tensors[t].dtype, 0, set});
      const int64_t end = lay_out(L, Side::kReceiver, bi, set, {{t, random_sub_box(r_, L.tensors[t].shape)}});
      L.buffers[bi].bytes = (end + r_.uni(0, 2)) * dtype_bytes(L.tensors[t].dtype);
    }
  }

  // q, k, v of shapes [rq, c], [rk, c], [rk, c], sharded over each instance's
  // ranks by rows as vLLM's QKVParallelLinear does (k and v rows replicated
  // when tp > rk), cat into one "qkv" buffer per rank with gaps and sometimes
  // a transposed segment. Ranks with the same tp rank share one region.
  void add_qkv(Layout& L, int isz) {
    ++features["qkv-like fused buffer"];
    const DType dt = random_dtype();
    const int64_t c = r_.uni(1, 8), rq = r_.uni(1, 12), rk = r_.uni(1, static_cast<int>(rq));
    const int nsrc = L.num_ranks(Side::kSource), nrcv = L.num_ranks(Side::kReceiver);
    const std::string prefix = "qkv" + std::to_string(L.tensors.size());
    uint32_t ids[3];
    const int64_t rows[3] = {rq, rk, rk};
    const char* names[3] = {".q", ".k", ".v"};
    for (int i = 0; i < 3; ++i) {
      ids[i] = L.add_tensor(prefix + names[i], dt, {rows[i], c});
      auto ranks = shuffled(nsrc);
      ranks.resize(r_.uni(1, nsrc));
      add_spec(L, ids[i], Side::kSource, ranks, prefix + names[i]);
    }
    const int tp = isz;
    std::vector<int32_t> all(nrcv);
    std::iota(all.begin(), all.end(), 0);
    const RankSetId holders = L.receiver_sets.intern(all);
    const uint32_t bi = L.add_buffer({Side::kReceiver, prefix, dt, 0, holders});
    const bool transpose_one = r_.coin(0.4);
    const int which_t = r_.uni(0, 2);
    int64_t max_end = 0;
    for (int i = 0; i < tp; ++i) {
      std::vector<int32_t> ranks;
      for (int x = i; x < nrcv; x += tp) ranks.push_back(x);
      const RankSetId set = L.receiver_sets.intern(ranks);
      int64_t cur = r_.uni(0, 3);
      for (int k = 0; k < 3; ++k) {
        std::pair<int64_t, int64_t> span;
        if (k == 0 || rk >= tp)
          span = torch_chunk(rows[k], tp, i);
        else
          span = torch_chunk(rk, rk, i * rk / tp);
        if (span.second <= span.first) continue;  // torch.chunk left this rank nothing
        Box b;
        b.ndim = 2;
        b.start[0] = span.first;
        b.size[0] = span.second - span.first;
        b.size[1] = c;
        Index s{};
        if (transpose_one && k == which_t) {
          ++features["transposed segment (strides [1, rows])"];
          s[0] = 1;
          s[1] = b.size[0];
        } else {
          s[0] = c;
          s[1] = 1;
        }
        L.tensors[ids[k]].receivers.push_back(Region{b, set, bi, cur, s});
        cur += b.numel() + r_.uni(0, 3);
      }
      max_end = std::max(max_end, cur);
    }
    L.buffers[bi].bytes = (max_end + r_.uni(0, 2)) * dtype_bytes(dt);
  }

  // Lays `segs` out one after another with gaps in buffer `bi` for the ranks
  // of `set`, with random strides; sometimes two segments of one shape are
  // interleaved (element by element, or row by row). Returns the end offset.
  int64_t lay_out(Layout& L, Side side, uint32_t bi, RankSetId set, const std::vector<Segment>& segs) {
    int64_t cur = r_.uni(0, 3);
    for (size_t i = 0; i < segs.size(); ++i) {
      const Box& box = segs[i].box;
      const bool pair = i + 1 < segs.size() && box.ndim > 0 && segs[i + 1].box.ndim == box.ndim &&
                        segs[i + 1].box.size == box.size && r_.coin(0.5);
      if (pair) {
        ++features["interleaved pair of segments"];
        const int nd = box.ndim;
        Index s{};
        const bool by_row = nd >= 2 && r_.coin(0.5);
        int64_t shift;
        if (by_row) {
          s[nd - 1] = 1;
          s[nd - 2] = 2 * box.size[nd - 1];
          for (int d = nd - 3; d >= 0; --d) s[d] = s[d + 1] * box.size[d + 1];
          shift = box.size[nd - 1];
        } else {
          s[nd - 1] = 2;
          for (int d = nd - 2; d >= 0; --d) s[d] = s[d + 1] * box.size[d + 1];
          shift = 1;
        }
        int64_t extent = 1;
        for (int d = 0; d < nd; ++d) extent += (box.size[d] - 1) * s[d];
        L.regions(segs[i].tensor, side).push_back(Region{box, set, bi, cur, s});
        L.regions(segs[i + 1].tensor, side).push_back(Region{segs[i + 1].box, set, bi, cur + shift, s});
        cur += extent + shift + r_.uni(0, 3);
        ++i;
        continue;
      }
      int64_t extent;
      Index s = random_strides(r_, box, &extent);
      int64_t offset = cur;
      if (box.ndim > 0 && r_.coin(0.05)) {
        // A reversed dim: a negative stride, box.start mapped to the far end.
        const int d = r_.uni(0, box.ndim - 1);
        offset += (box.size[d] - 1) * s[d];
        s[d] = -s[d];
        ++features["segment with a negative stride (reversed dim)"];
      }
      if (extent > box.numel()) ++features["segment with gaps inside (padded strides)"];
      for (int d = 0; d + 1 < box.ndim; ++d)
        if (s[d] < s[d + 1] && box.size[d] > 1 && box.size[d + 1] > 1) {
          ++features["segment with permuted (transposed) strides"];
          break;
        }
      L.regions(segs[i].tensor, side).push_back(Region{box, set, bi, offset, s});
      cur += extent + r_.uni(0, 3);
    }
    return cur;
  }

  // Segments of tensors of one dtype: random sub-boxes, sometimes the same
  // shape twice in a row so that lay_out can interleave them.
  std::vector<Segment> random_segments(const Layout& L, DType dt, int n) {
    std::vector<uint32_t> pool;
    for (uint32_t t = 0; t < L.tensors.size(); ++t)
      if (L.tensors[t].dtype == dt) pool.push_back(t);
    std::vector<Segment> segs;
    for (int i = 0; i < n; ++i) {
      const uint32_t t = pool[r_.uni(0, static_cast<int>(pool.size()) - 1)];
      Box b = random_sub_box(r_, L.tensors[t].shape);
      if (!segs.empty() && r_.coin(0.3)) {
        // Same shape as the previous segment, if this tensor has room for it.
        const Box& p = segs.back().box;
        bool fits = p.ndim == b.ndim;
        for (int d = 0; fits && d < b.ndim; ++d) fits = p.size[d] <= L.tensors[t].shape[d];
        if (fits) {
          for (int d = 0; d < b.ndim; ++d) {
            b.size[d] = p.size[d];
            b.start[d] = r_.uni(0, static_cast<int>(L.tensors[t].shape[d] - p.size[d]));
          }
        }
      }
      segs.push_back({t, b});
    }
    return segs;
  }

  // An explicit buffer holding parts of several tensors (of the dtype of a
  // random tensor): on the source side a publish arena, on the receiver side
  // a fused parameter. Either every rank of the buffer holds the same
  // segments, or each rank holds its own.
  void add_composite(Layout& L, Side side, const std::string& name) {
    ++features[side == Side::kSource ? "source arena buffer" : "fused receiver buffer"];
    const DType dt = L.tensors[r_.uni(0, static_cast<int>(L.tensors.size()) - 1)].dtype;
    const int n = L.num_ranks(side);
    auto ranks = shuffled(n);
    ranks.resize(r_.uni(1, std::min(3, n)));
    std::sort(ranks.begin(), ranks.end());
    const RankSetId holders = L.sets(side).intern(ranks);
    const uint32_t bi = L.add_buffer({side, name, dt, 0, holders});
    int64_t end = 0;
    if (ranks.size() > 1 && r_.coin(0.3)) {
      ++features["buffer whose ranks hold different segments"];
      for (int32_t x : ranks) {
        const RankSetId one = L.sets(side).intern({x});
        end = std::max(end, lay_out(L, side, bi, one, random_segments(L, dt, r_.uni(1, 4))));
      }
    } else {
      end = lay_out(L, side, bi, holders, random_segments(L, dt, r_.uni(1, 4)));
    }
    L.buffers[bi].bytes = (end + r_.uni(0, 3)) * dtype_bytes(dt);
  }

  Rng r_;
};

// ---------------------------------------------------------------------------
// The brute-force reference of one layout.

struct Reference {
  const Layout* L = nullptr;
  int ndomains = 0;
  std::vector<int64_t> byte_base;  // tensor t's bytes start here in a flat index of all tensors' bytes
  int64_t total_bytes = 0;
  // [buffer][rank] -> one tag per byte; empty where the rank lacks the buffer.
  std::vector<std::vector<std::vector<uint64_t>>> initial;   // sources: tags or junk; receivers: sentinel
  std::vector<std::vector<std::vector<uint64_t>>> expected;  // receivers after a refresh
  std::vector<std::vector<std::vector<char>>> holds;         // [tensor][source rank][element]
  std::vector<std::vector<std::vector<char>>> need_domain;   // [tensor][domain][element]
  std::vector<std::vector<std::vector<char>>> need_rank;     // [tensor][receiver rank][element]
  // Sums over domains, and over receiver ranks, of distinct needed elements * element size.
  int64_t min_domain_bytes = 0;
  int64_t min_rank_bytes = 0;
};

Reference make_reference(const Layout& L) {
  Reference R;
  R.L = &L;
  for (const ReceiverRank& r : L.receivers) R.ndomains = std::max(R.ndomains, r.domain + 1);
  for (const Tensor& t : L.tensors) {
    R.byte_base.push_back(R.total_bytes);
    R.total_bytes += t.bytes();
  }
  R.initial.resize(L.buffers.size());
  for (size_t bi = 0; bi < L.buffers.size(); ++bi) {
    const Buffer& b = L.buffers[bi];
    R.initial[bi].resize(L.num_ranks(b.side));
    for (int32_t r : L.sets(b.side).get(b.ranks))
      R.initial[bi][r].assign(b.bytes, b.side == Side::kSource ? kJunk : kSentinel);
  }
  R.expected = R.initial;
  const int nsrc = L.num_ranks(Side::kSource), nrcv = L.num_ranks(Side::kReceiver);
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    const int eb = dtype_bytes(t.dtype);
    const int64_t n = numel_of(t.shape);
    R.holds.emplace_back(nsrc, std::vector<char>(n, 0));
    R.need_domain.emplace_back(R.ndomains, std::vector<char>(n, 0));
    R.need_rank.emplace_back(nrcv, std::vector<char>(n, 0));
    for (const Region& reg : t.sources) {
      for (int32_t r : L.source_sets.get(reg.ranks)) {
        for_each_element(reg.box, [&](const Index& idx) {
          const int64_t g = linear_index(t.shape, idx);
          const int64_t off = element_offset(reg, idx);
          for (int k = 0; k < eb; ++k) R.initial[t.buffer_of(Side::kSource, reg)][r][off * eb + k] = byte_tag(ti, g, k);
          R.holds[ti][r][g] = 1;
        });
      }
    }
    for (const Region& reg : t.receivers) {
      for (int32_t r : L.receiver_sets.get(reg.ranks)) {
        for_each_element(reg.box, [&](const Index& idx) {
          const int64_t g = linear_index(t.shape, idx);
          const int64_t off = element_offset(reg, idx);
          for (int k = 0; k < eb; ++k) R.expected[t.buffer_of(Side::kReceiver, reg)][r][off * eb + k] = byte_tag(ti, g, k);
          R.need_domain[ti][L.receivers[r].domain][g] = 1;
          R.need_rank[ti][r][g] = 1;
        });
      }
    }
    for (const auto& v : R.need_domain[ti]) R.min_domain_bytes += std::count(v.begin(), v.end(), 1) * eb;
    for (const auto& v : R.need_rank[ti]) R.min_rank_bytes += std::count(v.begin(), v.end(), 1) * eb;
  }
  return R;
}

// ---------------------------------------------------------------------------
// Violations, recorded per property: how many, and the first one in full.

struct Violations {
  struct Entry {
    int64_t count = 0;
    std::string first;
  };
  std::map<std::string, Entry> by_property;
  // Describes the layout being checked; called for a property's first violation only.
  std::function<std::string()> context = [] { return std::string(); };

  void add(const std::string& property, const std::string& what) {
    Entry& e = by_property[property];
    if (e.count++ == 0) e.first = what + "\n" + context();
  }
  std::string report(const std::string& property) const {
    auto it = by_property.find(property);
    if (it == by_property.end()) return "";
    return std::to_string(it->second.count) + " violation(s); first: " + it->second.first;
  }
  int64_t count(const std::string& property) const {
    auto it = by_property.find(property);
    return it == by_property.end() ? 0 : it->second.count;
  }
};

struct SimTotals {
  int64_t runs = 0;
  int64_t net_runs = 0;
  int64_t local_runs = 0;
  int64_t bytes = 0;
};

// Executes `runs` on the reference's buffers and checks every property of a
// plan made with `plan.options().strategy` (kRefit or kNoDedup). Properties:
//   run_shape            a run names real buffers of the right sides, in bounds
//   net_from_source      a net run reads a source buffer, only bytes a source region maps
//   local_in_domain      a local run reads a receiver of the target's domain (its own rank under kNoDedup)
//   local_reads_written  a local run reads only bytes an earlier run wrote
//   written_once         each byte a receiver segment covers ends right, written once
//   untouched            bytes outside all receiver segments are never written
//   net_once             each group (domain, or rank under kNoDedup) receives each needed byte over net once
//   summary_bytes        summary network/local bytes equal the runs' bytes
//   minimum_bytes        minimum_network_bytes is the reference's; under kRefit network == minimum
//   no_dedup_bytes       under kNoDedup network == sum over ranks of their distinct bytes
//   nic                  per-rank NIC totals and their maxima equal the runs' bytes
//   units                unit, consumer and piece structure is consistent
//   source_picks         each piece's chosen source really holds it; holders are all regions holding it
//   summary_counts       units, pulls, tensors, total bytes in the summary agree with the plan
//   summary_chunks       summary chunks == the chunks for_each_run cuts the pieces into
void check_plan(const Reference& R, const Plan& plan, const std::vector<Run>& runs, Violations& v, SimTotals& tot) {
  const Layout& L = *R.L;
  const bool no_dedup = plan.options().strategy == Strategy::kNoDedup;
  const int ngroups = no_dedup ? L.num_ranks(Side::kReceiver) : R.ndomains;
  auto group_of = [&](int32_t rcv) { return no_dedup ? rcv : L.receivers[rcv].domain; };

  auto mem = R.initial;
  std::vector<std::vector<std::vector<uint8_t>>> writes(L.buffers.size());
  for (size_t bi = 0; bi < L.buffers.size(); ++bi) {
    if (L.buffers[bi].side != Side::kReceiver) continue;
    writes[bi].resize(mem[bi].size());
    for (size_t r = 0; r < mem[bi].size(); ++r) writes[bi][r].assign(mem[bi][r].size(), 0);
  }
  std::vector<std::vector<uint8_t>> net_count(ngroups, std::vector<uint8_t>(R.total_bytes, 0));
  std::vector<int64_t> src_nic(L.num_ranks(Side::kSource), 0), rcv_nic(L.num_ranks(Side::kReceiver), 0);
  int64_t net_bytes = 0, local_bytes = 0;

  auto end_ok = [&](const RunEnd& e, Side side, int64_t bytes) {
    if (e.side != side || e.buffer >= L.buffers.size() || L.buffers[e.buffer].side != side) return false;
    if (e.rank < 0 || e.rank >= L.num_ranks(side)) return false;
    const auto& m = mem[e.buffer][e.rank];
    return !m.empty() && e.offset >= 0 && bytes > 0 && e.offset + bytes <= static_cast<int64_t>(m.size());
  };

  std::vector<uint64_t> tmp;
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& run = runs[i];
    const std::string where = "run #" + std::to_string(i) + ": " + run_str(run);
    ++tot.runs;
    tot.bytes += run.bytes;
    const Side from_side = run.local ? Side::kReceiver : Side::kSource;
    if (!end_ok(run.from, from_side, run.bytes) || !end_ok(run.to, Side::kReceiver, run.bytes)) {
      v.add(run.local ? "run_shape" : "net_from_source", where + ": names no such buffer, rank or byte range");
      continue;
    }
    const auto& from = mem[run.from.buffer][run.from.rank];
    tmp.assign(from.begin() + run.from.offset, from.begin() + run.from.offset + run.bytes);
    if (run.local) {
      ++tot.local_runs;
      local_bytes += run.bytes;
      if (L.receivers[run.from.rank].domain != L.receivers[run.to.rank].domain)
        v.add("local_in_domain", where + ": crosses from domain " + std::to_string(L.receivers[run.from.rank].domain) +
                                     " to domain " + std::to_string(L.receivers[run.to.rank].domain));
      if (no_dedup && run.from.rank != run.to.rank)
        v.add("local_in_domain", where + ": under no-dedup a rank copies only inside itself");
      const auto& w = writes[run.from.buffer][run.from.rank];
      for (int64_t k = 0; k < run.bytes; ++k) {
        if (w[run.from.offset + k] == 0) {
          v.add("local_reads_written",
                where + ": reads byte " + std::to_string(run.from.offset + k) + " before any run wrote it");
          break;
        }
      }
    } else {
      ++tot.net_runs;
      net_bytes += run.bytes;
      src_nic[run.from.rank] += run.bytes;
      rcv_nic[run.to.rank] += run.bytes;
      const int grp = group_of(run.to.rank);
      for (int64_t k = 0; k < run.bytes; ++k) {
        const uint64_t tag = tmp[k];
        if (tag == kJunk) {
          v.add("net_from_source", where + ": reads byte " + std::to_string(run.from.offset + k) +
                                       " that no source region of that rank maps");
          break;
        }
        const uint32_t t = tag_tensor(tag);
        uint8_t& c =
            net_count[grp][R.byte_base[t] + tag_element(tag) * dtype_bytes(L.tensors[t].dtype) + tag_byte(tag)];
        if (c < 255) ++c;
      }
    }
    auto& to = mem[run.to.buffer][run.to.rank];
    auto& w = writes[run.to.buffer][run.to.rank];
    for (int64_t k = 0; k < run.bytes; ++k) {
      to[run.to.offset + k] = tmp[k];
      if (w[run.to.offset + k] < 255) ++w[run.to.offset + k];
    }
  }

  // Receiver buffers against the layout.
  for (size_t bi = 0; bi < L.buffers.size(); ++bi) {
    if (L.buffers[bi].side != Side::kReceiver) continue;
    for (size_t r = 0; r < mem[bi].size(); ++r) {
      const auto& got = mem[bi][r];
      const auto& want = R.expected[bi][r];
      const auto& w = writes[bi][r];
      bool reported_cover = false, reported_gap = false;
      for (size_t k = 0; k < got.size(); ++k) {
        const std::string at =
            "receiver " + std::to_string(r) + " buf#" + std::to_string(bi) + " byte " + std::to_string(k);
        if (want[k] != kSentinel) {
          if (!reported_cover && (got[k] != want[k] || w[k] != 1)) {
            reported_cover = true;
            std::ostringstream os;
            os << at << ": written " << int(w[k]) << " times; holds ";
            if (got[k] == kSentinel)
              os << "nothing";
            else
              os << "tensor " << tag_tensor(got[k]) << " element " << tag_element(got[k]) << " byte "
                 << tag_byte(got[k]);
            os << ", wants tensor " << tag_tensor(want[k]) << " element " << tag_element(want[k]) << " byte "
               << tag_byte(want[k]);
            v.add("written_once", os.str());
          }
        } else if (!reported_gap && (w[k] != 0 || got[k] != kSentinel)) {
          reported_gap = true;
          v.add("untouched", at + ": outside every segment, written " + std::to_string(int(w[k])) + " times");
        }
      }
    }
  }

  // Each group receives each byte it needs over the network exactly once.
  for (int grp = 0; grp < ngroups; ++grp) {
    bool reported = false;
    for (uint32_t ti = 0; ti < L.tensors.size() && !reported; ++ti) {
      const int eb = dtype_bytes(L.tensors[ti].dtype);
      const auto& need = no_dedup ? R.need_rank[ti][grp] : R.need_domain[ti][grp];
      for (size_t g = 0; g < need.size() && !reported; ++g) {
        for (int k = 0; k < eb; ++k) {
          const int c = net_count[grp][R.byte_base[ti] + g * eb + k];
          if (c != (need[g] ? 1 : 0)) {
            reported = true;
            v.add("net_once", std::string(no_dedup ? "receiver rank " : "domain ") + std::to_string(grp) +
                                  " receives tensor \"" + L.tensors[ti].name + "\" element " + std::to_string(g) +
                                  " byte " + std::to_string(k) + " over the network " + std::to_string(c) +
                                  " times; it " + (need[g] ? "needs" : "does not need") + " it");
            break;
          }
        }
      }
    }
  }

  const PlanSummary& s = plan.summary();
  if (s.network_bytes != net_bytes || s.local_bytes != local_bytes)
    v.add("summary_bytes", "summary says network " + std::to_string(s.network_bytes) + " local " +
                               std::to_string(s.local_bytes) + "; the runs move network " + std::to_string(net_bytes) +
                               " local " + std::to_string(local_bytes));
  if (s.minimum_network_bytes != R.min_domain_bytes)
    v.add("minimum_bytes", "minimum_network_bytes " + std::to_string(s.minimum_network_bytes) +
                               ", reference (distinct elements per domain) " + std::to_string(R.min_domain_bytes));
  if (!no_dedup && (s.network_bytes != R.min_domain_bytes || net_bytes != R.min_domain_bytes))
    v.add("minimum_bytes", "refit moves " + std::to_string(net_bytes) + " network bytes (summary " +
                               std::to_string(s.network_bytes) + "), the minimum is " +
                               std::to_string(R.min_domain_bytes));
  if (no_dedup && (s.network_bytes != R.min_rank_bytes || net_bytes != R.min_rank_bytes))
    v.add("no_dedup_bytes", "no-dedup moves " + std::to_string(net_bytes) + " network bytes (summary " +
                                std::to_string(s.network_bytes) + "), ranks need " + std::to_string(R.min_rank_bytes));

  // NIC totals.
  if (plan.source_nic_bytes() != src_nic || plan.receiver_nic_bytes() != rcv_nic) {
    std::ostringstream os;
    os << "plan source NIC bytes";
    for (int64_t b : plan.source_nic_bytes()) os << " " << b;
    os << " vs runs";
    for (int64_t b : src_nic) os << " " << b;
    os << "; plan receiver NIC bytes";
    for (int64_t b : plan.receiver_nic_bytes()) os << " " << b;
    os << " vs runs";
    for (int64_t b : rcv_nic) os << " " << b;
    v.add("nic", os.str());
  }
  const int64_t max_src = src_nic.empty() ? 0 : *std::max_element(src_nic.begin(), src_nic.end());
  const int64_t max_rcv = rcv_nic.empty() ? 0 : *std::max_element(rcv_nic.begin(), rcv_nic.end());
  if (s.max_source_nic_bytes != max_src || s.max_receiver_nic_bytes != max_rcv)
    v.add("nic", "summary max NIC bytes source " + std::to_string(s.max_source_nic_bytes) + " receiver " +
                     std::to_string(s.max_receiver_nic_bytes) + "; runs give " + std::to_string(max_src) + " and " +
                     std::to_string(max_rcv));

  // Units, consumers, pieces, source picks.
  int64_t pulls = 0, chunks = 0;
  for (size_t ui = 0; ui < plan.units().size(); ++ui) {
    const Unit& u = plan.units()[ui];
    const std::string where = "unit #" + std::to_string(ui) + " (tensor " + std::to_string(u.tensor) + ", group " +
                              std::to_string(u.domain) + ", box " + plan.box(u).to_string() + ")";
    if (u.tensor >= L.tensors.size()) {
      v.add("units", where + ": no such tensor");
      continue;
    }
    const Tensor& t = L.tensors[u.tensor];
    const auto cs = plan.consumers(u);
    if (cs.empty() || u.puller >= cs.size()) {
      v.add("units", where + ": no consumers, or puller out of range");
      continue;
    }
    for (size_t k = 0; k < cs.size(); ++k) {
      const Consumer& c = cs[k];
      if (c.region >= t.receivers.size() || !in_set(L.receiver_sets.get(t.receivers[c.region].ranks), c.rank) ||
          group_of(c.rank) != u.domain || !contains(t.receivers[c.region].box, plan.box(u))) {
        v.add("units", where + ": consumer rank " + std::to_string(c.rank) + " region " + std::to_string(c.region) +
                           " is not a rank of that region in this group, or its box does not contain the unit");
      }
      for (size_t j = 0; j < k; ++j)
        if (cs[j].rank == c.rank && cs[j].region == c.region) v.add("units", where + ": a consumer appears twice");
    }
    const PullSet& ps = plan.pull_set(u);
    pulls += static_cast<int64_t>(ps.pieces.size());
    const int eb = dtype_bytes(t.dtype);
    int64_t sum = 0;
    bool forced = true;
    for (size_t i = 0; i < ps.pieces.size(); ++i) {
      const Piece& p = ps.pieces[i];
      chunks +=
          static_cast<int64_t>(split_row_major(p.box, std::max<int64_t>(1, plan.options().chunk_bytes / eb)).size());
      sum += p.box.numel();
      if (p.box.empty() || !contains(plan.box(u), p.box))
        v.add("units", where + ": piece " + p.box.to_string() + " is empty or outside the unit");
      for (size_t j = 0; j < i; ++j)
        if (overlaps(ps.pieces[j].box, p.box))
          v.add("units", where + ": pieces " + ps.pieces[j].box.to_string() + " and " + p.box.to_string() + " overlap");
      const auto hs = plan.holders(ps, p);
      std::vector<uint32_t> want;  // every source region that holds the whole piece
      for (uint32_t h = 0; h < t.sources.size(); ++h)
        if (contains(t.sources[h].box, p.box)) want.push_back(h);
      std::vector<uint32_t> got(hs.begin(), hs.end());
      std::sort(got.begin(), got.end());
      if (got != want)
        v.add("source_picks", where + ": piece " + p.box.to_string() + " lists " + std::to_string(got.size()) +
                                  " holder regions; " + std::to_string(want.size()) + " source regions hold it");
      std::vector<int32_t> holder_ranks;
      for (uint32_t h : hs)
        if (h < t.sources.size())
          for (int32_t x : L.source_sets.get(t.sources[h].ranks)) holder_ranks.push_back(x);
      std::sort(holder_ranks.begin(), holder_ranks.end());
      holder_ranks.erase(std::unique(holder_ranks.begin(), holder_ranks.end()), holder_ranks.end());
      forced = forced && holder_ranks.size() == 1;
      const SourcePick pick = plan.source(u, i);
      bool ok = pick.region < t.sources.size() && std::find(hs.begin(), hs.end(), pick.region) != hs.end() &&
                pick.rank >= 0 && pick.rank < L.num_ranks(Side::kSource) &&
                in_set(L.source_sets.get(t.sources[pick.region].ranks), pick.rank);
      if (ok) {
        for_each_element(
            p.box, [&](const Index& idx) { ok = ok && R.holds[u.tensor][pick.rank][linear_index(t.shape, idx)]; });
      }
      if (!ok)
        v.add("source_picks", where + ": piece " + p.box.to_string() + " is pulled from source rank " +
                                  std::to_string(pick.rank) + " region " + std::to_string(pick.region) +
                                  ", which does not hold all of it");
    }
    if (sum != plan.box(u).numel())
      v.add("units",
            where + ": pieces cover " + std::to_string(sum) + " of " + std::to_string(plan.box(u).numel()) + " elements");
    if (forced != ps.forced)
      v.add("units", where + ": pull set forced flag is " + std::to_string(ps.forced) + ", holders say " +
                         std::to_string(forced));
  }
  int64_t total = 0;
  for (const Tensor& t : L.tensors) total += t.bytes();
  if (s.units != static_cast<int64_t>(plan.units().size()) || s.pulls != pulls ||
      s.tensors != static_cast<int64_t>(L.tensors.size()) || s.total_bytes != total)
    v.add("summary_counts", "summary units/pulls/tensors/total_bytes " + std::to_string(s.units) + "/" +
                                std::to_string(s.pulls) + "/" + std::to_string(s.tensors) + "/" +
                                std::to_string(s.total_bytes) + "; the plan has " +
                                std::to_string(plan.units().size()) + "/" + std::to_string(pulls) + "/" +
                                std::to_string(L.tensors.size()) + "/" + std::to_string(total));
  if (s.chunks != chunks)
    v.add("summary_chunks", "summary chunks " + std::to_string(s.chunks) + "; for_each_run cuts the pieces into " +
                                std::to_string(chunks) + " (split_row_major, chunk_bytes / element size each)");
}

// Empty when a and b are the same plan, else what differs.
std::string plan_difference(const Plan& a, const std::vector<Run>& ra, const Plan& b, const std::vector<Run>& rb) {
  if (ra.size() != rb.size()) return "run counts " + std::to_string(ra.size()) + " vs " + std::to_string(rb.size());
  for (size_t i = 0; i < ra.size(); ++i)
    if (!same_run(ra[i], rb[i]))
      return "run #" + std::to_string(i) + ": " + run_str(ra[i]) + " vs " + run_str(rb[i]);
  if (a.units().size() != b.units().size()) return "unit counts differ";
  if (a.pull_sets().size() != b.pull_sets().size()) return "pull set counts differ";
  for (size_t i = 0; i < a.units().size(); ++i) {
    const Unit& x = a.units()[i];
    const Unit& y = b.units()[i];
    if (x.tensor != y.tensor || x.domain != y.domain || a.box(x) != b.box(y) || x.consumers_count != y.consumers_count ||
        x.puller != y.puller || x.pull_set != y.pull_set)
      return "unit #" + std::to_string(i) + " differs";
    auto cx = a.consumers(x), cy = b.consumers(y);
    for (size_t k = 0; k < cx.size(); ++k)
      if (cx[k].rank != cy[k].rank || cx[k].region != cy[k].region)
        return "unit #" + std::to_string(i) + " consumers differ";
    const PullSet& px = a.pull_set(x);
    const PullSet& py = b.pull_set(y);
    if (px.pieces.size() != py.pieces.size() || px.forced != py.forced)
      return "unit #" + std::to_string(i) + " pieces differ";
    for (size_t k = 0; k < px.pieces.size(); ++k) {
      if (px.pieces[k].box != py.pieces[k].box) return "unit #" + std::to_string(i) + " piece boxes differ";
      auto hx = a.holders(px, px.pieces[k]);
      auto hy = b.holders(py, py.pieces[k]);
      if (!std::equal(hx.begin(), hx.end(), hy.begin(), hy.end()))
        return "unit #" + std::to_string(i) + " holders differ";
      const SourcePick sx = a.source(x, k), sy = b.source(y, k);
      if (sx.rank != sy.rank || sx.region != sy.region) return "unit #" + std::to_string(i) + " source picks differ";
    }
  }
  const PlanSummary& s = a.summary();
  const PlanSummary& t = b.summary();
  if (s.network_bytes != t.network_bytes || s.local_bytes != t.local_bytes || s.units != t.units ||
      s.pulls != t.pulls || s.chunks != t.chunks || s.max_source_nic_bytes != t.max_source_nic_bytes ||
      s.max_receiver_nic_bytes != t.max_receiver_nic_bytes)
    return "summaries differ";
  if (a.source_nic_bytes() != b.source_nic_bytes() || a.receiver_nic_bytes() != b.receiver_nic_bytes())
    return "NIC totals differ";
  return "";
}

int64_t random_chunk_bytes(Rng& r) {
  switch (r.uni(0, 3)) {
    case 0: return int64_t{4} << 20;  // the default: a piece is one chunk
    case 1: return r.uni(1, 7);       // below one element for most dtypes
    case 2: return r.uni(8, 64);
    default: return r.uni(65, 1024);
  }
}

// ---------------------------------------------------------------------------
// The sweep: every random layout, planned under kRefit (twice, and once more
// from a layout rebuilt from the same seed), kNoDedup and kBroadcast.

constexpr uint64_t kSweepSeed = 0x5eed'0001;
constexpr int kSweepLayouts = 10000;

struct Sweep {
  Violations v;
  std::map<std::string, int64_t> features;  // how many layouts exercised each feature
  int64_t layouts = 0;
  int64_t plans = 0;
  int64_t units = 0;
  SimTotals totals;
  int64_t network_bytes = 0;
  int64_t local_bytes = 0;
  double seconds = 0;
};

const Sweep& sweep() {
  static const Sweep result = [] {
    Sweep S;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSweepLayouts; ++i) {
      const uint64_t seed = kSweepSeed + static_cast<uint64_t>(i);
      LayoutGen gen(seed);
      Layout L = gen.make();
      S.v.context = [&] { return "seed " + std::to_string(seed) + ", layout:\n" + describe(L); };
      ++S.layouts;
      if (Status st = validate(L); !st.is_ok()) {
        S.v.add("validate", "generated layout fails validate(): " + st.message());
        continue;
      }
      const Reference R = make_reference(L);
      for (const auto& [name, n] : gen.features)
        if (n > 0) ++S.features[name];
      // Elements that two domains need: the case per-domain dedup is about.
      bool shared = false;
      for (const auto& per_tensor : R.need_domain)
        for (size_t g = 0; g < (per_tensor.empty() ? 0 : per_tensor[0].size()) && !shared; ++g) {
          int n = 0;
          for (const auto& d : per_tensor) n += d[g];
          shared = n > 1;
        }
      if (shared) ++S.features["an element needed by two domains"];
      PlanOptions o;
      o.chunk_bytes = random_chunk_bytes(gen.rng());
      S.v.context = [&] {
        return "seed " + std::to_string(seed) + ", chunk_bytes " + std::to_string(o.chunk_bytes) + ", layout:\n" +
               describe(L);
      };

      auto p1 = make_plan(L, o);
      ++S.plans;
      if (!p1) {
        S.v.add("plan_ok", "make_plan failed: " + p1.status().message());
        continue;
      }
      const auto runs1 = collect_runs(*p1);
      check_plan(R, *p1, runs1, S.v, S.totals);
      {  // network_runs: for_each_network_run gives for_each_run's network runs, in its order
        std::vector<Run> net, want;
        for_each_network_run(*p1, [&](const Run& r) { net.push_back(r); });
        for (const Run& r : runs1)
          if (!r.local) want.push_back(r);
        if (net.size() != want.size() || !std::equal(net.begin(), net.end(), want.begin(), same_run))
          S.v.add("network_runs", "for_each_network_run gave " + std::to_string(net.size()) +
                                      " runs; for_each_run has " + std::to_string(want.size()) + " network runs" +
                                      (net.size() == want.size() ? ", in another order or merged differently" : ""));
      }
      {
        bool fan_out = false, choice = false, several_pieces = false;
        for (const Unit& u : p1->units()) {
          const auto cs = p1->consumers(u);
          fan_out = fan_out || cs.size() > 1;
          choice = choice || !p1->pull_set(u).forced;
          several_pieces = several_pieces || p1->pull_set(u).pieces.size() > 1;
        }
        if (fan_out) ++S.features["plan with local fan-out"];
        if (choice) ++S.features["plan with a choice of source"];
        if (several_pieces) ++S.features["plan with a unit cut into several pieces"];
      }
      S.units += static_cast<int64_t>(p1->units().size());
      S.network_bytes += p1->summary().network_bytes;
      S.local_bytes += p1->summary().local_bytes;

      // Determinism: the same layout again, and the same layout built afresh.
      auto p2 = make_plan(L, o);
      LayoutGen gen2(seed);
      Layout L2 = gen2.make();
      auto p3 = make_plan(L2, o);
      // And on threads, a range of tensors each (the same plan, ids and all).
      PlanOptions on_threads = o;
      on_threads.threads = 1 + static_cast<int>(seed % 3) * 2;
      auto p4 = make_plan(L, on_threads);
      S.plans += 3;
      if (!p2 || !p3 || !p4) {
        S.v.add("deterministic", "a second make_plan of the same layout failed");
      } else {
        std::string d = plan_difference(*p1, runs1, *p2, collect_runs(*p2));
        if (d.empty()) d = plan_difference(*p1, runs1, *p3, collect_runs(*p3));
        if (d.empty()) {
          d = plan_difference(*p1, runs1, *p4, collect_runs(*p4));
          if (!d.empty()) d = "on " + std::to_string(on_threads.threads) + " threads: " + d;
        }
        if (!d.empty()) S.v.add("deterministic", d);
      }

      PlanOptions nd = o;
      nd.strategy = Strategy::kNoDedup;
      auto pn = make_plan(L, nd);
      ++S.plans;
      if (!pn) {
        S.v.add("plan_ok", "make_plan (no-dedup) failed: " + pn.status().message());
        continue;
      }
      check_plan(R, *pn, collect_runs(*pn), S.v, S.totals);

      // The baselines cost at least what refit does.
      PlanOptions bo = o;
      bo.strategy = Strategy::kBroadcast;
      auto pb = make_plan(L, bo);
      ++S.plans;
      if (!pb) {
        S.v.add("plan_ok", "make_plan (broadcast) failed: " + pb.status().message());
      } else if (!pb->units().empty() || pb->summary().network_bytes < pn->summary().network_bytes ||
                 pn->summary().network_bytes < p1->summary().network_bytes) {
        S.v.add("strategies_ordered", "network bytes refit " + std::to_string(p1->summary().network_bytes) +
                                          ", no-dedup " + std::to_string(pn->summary().network_bytes) + ", broadcast " +
                                          std::to_string(pb->summary().network_bytes) + " (broadcast units " +
                                          std::to_string(pb->units().size()) + ")");
      }
    }
    S.v.context = [] { return std::string(); };  // it referred to the loop's locals
    S.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "[ sweep    ] " << S.layouts << " random layouts, " << S.plans << " plans, " << S.units
              << " refit units, " << S.totals.runs << " runs executed (" << S.totals.net_runs << " net, "
              << S.totals.local_runs << " local, " << S.totals.bytes << " bytes; refit network " << S.network_bytes
              << " local " << S.local_bytes << ") in " << S.seconds << " s\n";
    for (const auto& [name, n] : S.features) std::cout << "[ sweep    ]   " << n << " layouts: " << name << "\n";
    return S;
  }();
  return result;
}

#define EXPECT_PROPERTY(name) EXPECT_EQ(sweep().v.count(name), 0) << sweep().v.report(name)

TEST(PlanProperty, GeneratedLayoutsAreValidAndPlannable) {
  EXPECT_PROPERTY("validate");
  EXPECT_PROPERTY("plan_ok");
  EXPECT_EQ(sweep().layouts, kSweepLayouts);
}

TEST(PlanProperty, EachCoveredByteWrittenOnce) { EXPECT_PROPERTY("written_once"); }

TEST(PlanProperty, BytesOutsideSegmentsNeverWritten) { EXPECT_PROPERTY("untouched"); }

TEST(PlanProperty, RunsNameRealBuffersInBounds) { EXPECT_PROPERTY("run_shape"); }

TEST(PlanProperty, NetRunsReadSourceRegions) { EXPECT_PROPERTY("net_from_source"); }

TEST(PlanProperty, LocalRunsReadWrittenBytesInDomain) {
  EXPECT_PROPERTY("local_in_domain");
  EXPECT_PROPERTY("local_reads_written");
}

TEST(PlanProperty, EachDomainReceivesEachByteOnce) {
  EXPECT_PROPERTY("net_once");
  EXPECT_PROPERTY("minimum_bytes");
}

TEST(PlanProperty, SummaryBytesMatchRuns) {
  EXPECT_PROPERTY("summary_bytes");
  EXPECT_PROPERTY("summary_counts");
}

TEST(PlanProperty, NicTotalsMatchRuns) { EXPECT_PROPERTY("nic"); }

TEST(PlanProperty, UnitsAreConsistent) { EXPECT_PROPERTY("units"); }

TEST(PlanProperty, SourcePicksHoldTheirPieces) { EXPECT_PROPERTY("source_picks"); }

TEST(PlanProperty, Deterministic) { EXPECT_PROPERTY("deterministic"); }

TEST(PlanProperty, NoDedupPullsWhatEachRankNeeds) { EXPECT_PROPERTY("no_dedup_bytes"); }

TEST(PlanProperty, BaselinesMoveAtLeastRefitBytes) { EXPECT_PROPERTY("strategies_ordered"); }

TEST(PlanProperty, SummaryChunksMatchRuns) { EXPECT_PROPERTY("summary_chunks"); }

TEST(PlanProperty, NetworkRunsAreTheFullWalksOnes) { EXPECT_PROPERTY("network_runs"); }

// Minimal reproduction: tensors "a" (BF16) and "b" (F32) of one shape on the
// same source rank share a pull set; chunk_bytes 8 gives "a" 4 chunks of 4
// elements and "b" 8 chunks of 2, so 12 in all, as for_each_run cuts them.
TEST(PlanProperty, ChunkCountUsesEachTensorsElementSize) {
  Layout L;
  L.sources = {{0}};
  L.receivers = {{0, 0}};
  for (auto [name, dt] : {std::pair{"a", DType::kBF16}, std::pair{"b", DType::kF32}}) {
    const uint32_t t = L.add_tensor(name, dt, {4, 4});
    const DTensorSpec one{{1}, {0}, {Placement{}}};
    ASSERT_TRUE(add_dtensor(L, t, Side::kSource, one, name).is_ok());
    ASSERT_TRUE(add_dtensor(L, t, Side::kReceiver, one, name).is_ok());
  }
  ASSERT_TRUE(validate(L).is_ok());
  PlanOptions o;
  o.chunk_bytes = 8;
  auto p = make_plan(L, o);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  int64_t chunks = 0;
  for (const Unit& u : p->units())
    for (const Piece& pc : p->pull_set(u).pieces)
      chunks += static_cast<int64_t>(split_row_major(pc.box, 8 / dtype_bytes(L.tensors[u.tensor].dtype)).size());
  EXPECT_EQ(chunks, 12);
  EXPECT_EQ(p->summary().chunks, 12);
}

// The reference is not vacuous: run lists broken on purpose are caught.
TEST(PlanProperty, CheckerCatchesBrokenRuns) {
  // (refit::Run: inside a TEST, plain Run names testing::Test::Run.)
  const char* kMutations[] = {"drop a run", "repeat a net run", "hoist a local run to the front",
                              "shift a run's target by one byte", "shorten a run by one byte"};
  int tried[5] = {}, caught[5] = {};
  for (int i = 0; i < 300; ++i) {
    LayoutGen gen(0xbad0'0000 + static_cast<uint64_t>(i));
    Layout L = gen.make();
    ASSERT_TRUE(validate(L).is_ok());
    auto p = make_plan(L);
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    const auto runs = collect_runs(*p);
    if (runs.empty()) continue;
    const Reference R = make_reference(L);
    Rng& r = gen.rng();
    for (int m = 0; m < 5; ++m) {
      std::vector<refit::Run> bad = runs;
      const size_t k = static_cast<size_t>(r.uni(0, static_cast<int>(runs.size()) - 1));
      switch (m) {
        case 0: bad.erase(bad.begin() + k); break;
        case 1: {
          auto it = std::find_if(bad.begin(), bad.end(), [](const refit::Run& x) { return !x.local; });
          bad.push_back(*it);
          break;
        }
        case 2: {
          auto it = std::find_if(bad.begin(), bad.end(), [](const refit::Run& x) { return x.local; });
          if (it == bad.end()) continue;
          const refit::Run x = *it;
          bad.erase(it);
          bad.insert(bad.begin(), x);
          break;
        }
        case 3: bad[k].to.offset += 1; break;
        case 4:
          if (bad[k].bytes < 2) continue;
          bad[k].bytes -= 1;
          break;
      }
      ++tried[m];
      Violations v;
      SimTotals tot;
      check_plan(R, *p, bad, v, tot);
      if (!v.by_property.empty()) ++caught[m];
    }
  }
  for (int m = 0; m < 5; ++m) {
    EXPECT_GT(tried[m], 50) << kMutations[m];
    EXPECT_EQ(caught[m], tried[m]) << kMutations[m];
  }
}

// A segment whose own elements overlap (strides [1, 1] on a 2x2 box, or a
// stride of 0) cannot be written "each byte once": validate() must refuse it,
// as it refuses two overlapping segments. Minimal reproduction.
TEST(PlanProperty, ValidateRefusesSelfOverlappingSegment) {
  for (int64_t s0 : {1, 0}) {
    Layout L;
    L.sources = {{0}};
    L.receivers = {{0, 0}};
    const uint32_t t = L.add_tensor("w", DType::kU8, {2, 2});
    const RankSetId s = L.source_sets.intern({0});
    const RankSetId r = L.receiver_sets.intern({0});
    const uint32_t sb = L.add_buffer({Side::kSource, "w", DType::kU8, 4, s});
    const uint32_t rb = L.add_buffer({Side::kReceiver, "w", DType::kU8, 4, r});
    const Box b = Box::whole({2, 2});
    L.tensors[t].sources.push_back(Region{b, s, sb, 0, row_major_strides({2, 2})});
    Index strides{};
    strides[0] = s0;  // [1, 1]: elements (0,1) and (1,0) share byte 1; [0, 1]: rows share bytes 0-1
    strides[1] = 1;
    L.tensors[t].receivers.push_back(Region{b, r, rb, 0, strides});
    EXPECT_FALSE(validate(L).is_ok()) << "receiver segment [0:2, 0:2] with strides [" << s0
                                      << ", 1] maps two elements to one byte";
  }
}

TEST(PlanProperty, NoOtherViolations) {
  static const char* kKnown[] = {"validate",
                                 "plan_ok",
                                 "written_once",
                                 "untouched",
                                 "run_shape",
                                 "net_from_source",
                                 "local_in_domain",
                                 "local_reads_written",
                                 "net_once",
                                 "minimum_bytes",
                                 "summary_bytes",
                                 "summary_counts",
                                 "nic",
                                 "units",
                                 "source_picks",
                                 "deterministic",
                                 "summary_chunks",
                                 "no_dedup_bytes",
                                 "strategies_ordered"};
  for (const auto& [name, e] : sweep().v.by_property) {
    const bool known = std::find_if(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return name == k; }) !=
                       std::end(kKnown);
    EXPECT_TRUE(known) << name << ": " << sweep().v.report(name);
  }
}

// ---------------------------------------------------------------------------
// A receiver that needs bytes no source holds.

// The first failing tensor in index order with uncovered needed elements is
// named, with a receiver rank that needs an uncovered element of it and a
// box of elements that no source holds and that rank needs.
TEST(PlanProperty, MissingSourceNamesTensorAndRank) {
  // Hand-made: rank 0 holds "w" rows 0-3, nobody holds rows 4-7, which
  // receiver rank 1 (domain 1) needs.
  {
    Layout L;
    L.sources = {{0}, {0}};
    L.receivers = {{0, 0}, {1, 0}};
    const uint32_t t = L.add_tensor("w", DType::kBF16, {8, 4});
    const RankSetId s0 = L.source_sets.intern({0});
    const uint32_t sb = L.add_buffer({Side::kSource, "w", DType::kBF16, 32, s0});
    Box half;
    half.ndim = 2;
    half.size[0] = 4;
    half.size[1] = 4;
    L.tensors[t].sources.push_back(Region{half, s0, sb, 0, row_major_strides({4, 4})});
    ASSERT_TRUE(
        add_dtensor(L, t, Side::kReceiver, DTensorSpec{{2}, {0, 1}, {Placement{Placement::Kind::kShard, 0, 1}}}, "w")
            .is_ok());
    ASSERT_TRUE(validate(L).is_ok());
    for (Strategy s : {Strategy::kRefit, Strategy::kNoDedup, Strategy::kBroadcast}) {
      PlanOptions o;
      o.strategy = s;
      auto p = make_plan(L, o);
      ASSERT_FALSE(p.is_ok()) << strategy_name(s);
      EXPECT_NE(p.status().message().find("tensor \"w\""), std::string::npos) << p.status().message();
      EXPECT_NE(p.status().message().find("receiver rank 1"), std::string::npos) << p.status().message();
      EXPECT_NE(p.status().message().find("[4:8, 0:4]"), std::string::npos) << p.status().message();
    }
  }

  // Random: drop some source regions of random layouts.
  const std::regex re("receiver rank ([0-9]+) needs tensor \"([^\"]+)\" box \\[([^\\]]*)\\]");
  int failing = 0, passing = 0;
  for (int i = 0; i < 600; ++i) {
    const uint64_t seed = 0x6a95'0000 + static_cast<uint64_t>(i);
    LayoutGen gen(seed);
    Layout L = gen.make();
    Rng& r = gen.rng();
    for (Tensor& t : L.tensors) {
      if (!r.coin(0.5)) continue;
      std::vector<Region> kept;
      for (const Region& reg : t.sources)
        if (r.coin(0.5)) kept.push_back(reg);
      t.sources = RegionList(std::move(kept));
    }
    ASSERT_TRUE(validate(L).is_ok()) << "seed " << seed;
    const Reference R = make_reference(L);
    // uncovered[t][g]: no source rank holds element g of tensor t.
    std::vector<std::vector<char>> uncovered(L.tensors.size());
    int first_gap = -1;
    for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
      const int64_t n = numel_of(L.tensors[ti].shape);
      uncovered[ti].assign(n, 1);
      for (const auto& h : R.holds[ti])
        for (int64_t g = 0; g < n; ++g)
          if (h[g]) uncovered[ti][g] = 0;
      bool gap = false;
      for (const auto& need : R.need_rank[ti])
        for (int64_t g = 0; g < n && !gap; ++g) gap = need[g] && uncovered[ti][g];
      if (gap && first_gap < 0) first_gap = static_cast<int>(ti);
    }
    PlanOptions o;
    o.chunk_bytes = random_chunk_bytes(r);
    auto p = make_plan(L, o);
    const std::string ctx = "seed " + std::to_string(seed) + ", layout:\n" + describe(L);
    if (first_gap < 0) {
      ++passing;
      ASSERT_TRUE(p.is_ok()) << p.status().message() << "\n" << ctx;
      Violations v;
      v.context = [&] { return ctx; };
      SimTotals tot;
      check_plan(R, *p, collect_runs(*p), v, tot);
      v.by_property.erase("summary_chunks");  // SummaryChunksMatchRuns covers it
      EXPECT_TRUE(v.by_property.empty()) << v.by_property.begin()->first << ": " << v.by_property.begin()->second.first;
      continue;
    }
    ++failing;
    ASSERT_FALSE(p.is_ok()) << "expected a missing-source error for tensor \"" << L.tensors[first_gap].name << "\"\n"
                            << ctx;
    const std::string msg = p.status().message();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(msg, m, re)) << msg << "\n" << ctx;
    const int32_t rank = std::stoi(m[1].str());
    EXPECT_EQ(m[2].str(), L.tensors[first_gap].name) << msg << "\n" << ctx;
    const int64_t ti = L.find_tensor(m[2].str());
    ASSERT_GE(ti, 0) << msg;
    ASSERT_LT(rank, L.num_ranks(Side::kReceiver)) << msg;
    // Parse "a:b, c:d" and check every element of that box is uncovered and needed by that rank.
    const Tensor& t = L.tensors[ti];
    Box b;
    b.ndim = static_cast<int>(t.shape.size());
    std::string dims = m[3].str();
    std::stringstream ss(dims);
    std::string part;
    int d = 0;
    while (std::getline(ss, part, ',') && d < b.ndim) {
      const auto colon = part.find(':');
      b.start[d] = std::stoll(part.substr(0, colon));
      b.size[d] = std::stoll(part.substr(colon + 1)) - b.start[d];
      ++d;
    }
    ASSERT_EQ(d, b.ndim) << msg;
    ASSERT_FALSE(b.empty()) << msg;
    bool all = true;
    for_each_element(b, [&](const Index& idx) {
      const int64_t g = linear_index(t.shape, idx);
      all = all && uncovered[ti][g] && R.need_rank[ti][rank][g];
    });
    EXPECT_TRUE(all) << "the named box is not all missing and needed by rank " << rank << ": " << msg << "\n" << ctx;
    for (Strategy s : {Strategy::kNoDedup, Strategy::kBroadcast}) {
      PlanOptions os = o;
      os.strategy = s;
      EXPECT_FALSE(make_plan(L, os).is_ok()) << strategy_name(s) << "\n" << ctx;
    }
  }
  std::cout << "[ missing  ] " << failing << " layouts with a missing source refused, " << passing
            << " without one planned and checked\n";
  EXPECT_GT(failing, 100);
  EXPECT_GT(passing, 100);
}

// ---------------------------------------------------------------------------
// Load balance with replicated sources.

// All tensors replicated on 4 source ranks (R), each needed in full by every
// one of 4-8 domains of 1-3 ranks: the greedy source choice is list
// scheduling, so the busiest source NIC carries at most the mean plus the
// largest piece, and no more than twice the mean. Inside a domain the puller
// choice balances the same way.
TEST(PlanProperty, ReplicatedSourcesSpreadLoad) {
  int64_t layouts = 0, runs = 0;
  for (int i = 0; i < 200; ++i) {
    const uint64_t seed = 0x10ad'0000 + static_cast<uint64_t>(i);
    Rng r(seed);
    Layout L;
    L.sources = {{0}, {0}, {1}, {1}};
    const int ndom = r.uni(4, 8);
    for (int dm = 0; dm < ndom; ++dm) {
      const int n = r.uni(1, 3);
      for (int k = 0; k < n; ++k) L.receivers.push_back({dm, dm});
    }
    const int nt = r.uni(3, 8);
    for (int ti = 0; ti < nt; ++ti) {
      const uint32_t t =
          L.add_tensor("t" + std::to_string(ti), r.coin(0.5) ? DType::kBF16 : DType::kF32, random_shape(r, 3, 500));
      const bool mesh2 = r.coin(0.5);
      DTensorSpec src;
      src.mesh = mesh2 ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{4};
      src.ranks = {0, 1, 2, 3};
      src.placements.assign(src.mesh.size(), Placement{});
      ASSERT_TRUE(add_dtensor(L, t, Side::kSource, src, L.tensors[t].name).is_ok());
      for (int dm = 0; dm < ndom; ++dm) {
        DTensorSpec rcv;
        for (int x = 0; x < L.num_ranks(Side::kReceiver); ++x)
          if (L.receivers[x].domain == dm) rcv.ranks.push_back(x);
        rcv.mesh = {static_cast<int64_t>(rcv.ranks.size())};
        rcv.placements = {Placement{}};  // every rank needs it all: pullers to balance
        ASSERT_TRUE(add_dtensor(L, t, Side::kReceiver, rcv, L.tensors[t].name).is_ok());
      }
    }
    ASSERT_TRUE(validate(L).is_ok());
    PlanOptions o;
    o.chunk_bytes = random_chunk_bytes(r);
    auto p = make_plan(L, o);
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    const auto all_runs = collect_runs(*p);
    const Reference R = make_reference(L);
    Violations v;
    v.context = [&] { return "seed " + std::to_string(seed) + "\n" + describe(L); };
    SimTotals tot;
    check_plan(R, *p, all_runs, v, tot);
    v.by_property.erase("summary_chunks");  // SummaryChunksMatchRuns covers it
    ASSERT_TRUE(v.by_property.empty()) << v.by_property.begin()->first << ": " << v.by_property.begin()->second.first;
    ++layouts;
    runs += static_cast<int64_t>(all_runs.size());

    int64_t largest = 0;
    for (const Unit& u : p->units())
      for (const Piece& pc : p->pull_set(u).pieces)
        largest = std::max<int64_t>(largest, pc.box.numel() * dtype_bytes(L.tensors[u.tensor].dtype));
    const auto& nic = p->source_nic_bytes();
    const int64_t total = std::accumulate(nic.begin(), nic.end(), int64_t{0});
    const int64_t mx = *std::max_element(nic.begin(), nic.end());
    EXPECT_EQ(total, p->summary().network_bytes);
    // mean = total / 4; compare multiplied through to stay in integers.
    EXPECT_LE(mx * 4, total + 4 * largest) << "seed " << seed;
    EXPECT_LE(mx * 4, 2 * total) << "seed " << seed << ": source NIC bytes " << nic[0] << " " << nic[1] << " " << nic[2]
                                 << " " << nic[3];
    // Pullers inside each domain.
    const auto& rn = p->receiver_nic_bytes();
    for (int dm = 0; dm < ndom; ++dm) {
      int64_t sum = 0, peak = 0, n = 0, biggest = 0;
      for (int x = 0; x < L.num_ranks(Side::kReceiver); ++x) {
        if (L.receivers[x].domain != dm) continue;
        sum += rn[x];
        peak = std::max(peak, rn[x]);
        ++n;
      }
      for (const Unit& u : p->units())
        if (u.domain == dm)
          biggest = std::max<int64_t>(biggest, p->box(u).numel() * dtype_bytes(L.tensors[u.tensor].dtype));
      EXPECT_LE(peak * n, sum + n * biggest) << "seed " << seed << " domain " << dm;
    }
  }
  std::cout << "[ balance  ] " << layouts << " replicated-source layouts, " << runs << " runs checked\n";
}

// ---------------------------------------------------------------------------
// for_each_copy against an element-by-element copy.

// Copies `box` from reg[0] (a buffer of size[0] elements) to reg[1] with
// for_each_copy and compares every byte of the target with an element-by-
// element copy; each byte the box covers written once, no other. Empty when
// they agree, else what differs; *runs gets the number of runs.
std::string copy_mismatch(const std::vector<int64_t>& shape, const Box& box, const Region (&reg)[2],
                          const int64_t (&size)[2], int eb, int64_t* runs) {
  std::vector<uint64_t> from(size[0] * eb, kJunk), to(size[1] * eb, kSentinel);
  std::vector<int> w(size[1] * eb, 0);
  for_each_element(reg[0].box, [&](const Index& idx) {
    for (int k = 0; k < eb; ++k) from[element_offset(reg[0], idx) * eb + k] = byte_tag(0, linear_index(shape, idx), k);
  });
  bool in_bounds = true;
  *runs = 0;
  for_each_copy(box, reg[0], reg[1], eb, [&](int64_t fo, int64_t tof, int64_t bytes) {
    ++*runs;
    if (fo < 0 || tof < 0 || bytes <= 0 || fo + bytes > static_cast<int64_t>(from.size()) ||
        tof + bytes > static_cast<int64_t>(to.size()) || fo % eb || tof % eb || bytes % eb) {
      in_bounds = false;
      return;
    }
    for (int64_t k = 0; k < bytes; ++k) {
      to[tof + k] = from[fo + k];
      ++w[tof + k];
    }
  });
  const std::string where = " box " + box.to_string() + " from " + reg[0].box.to_string() + " strides " +
                            strides_str(reg[0].strides, box.ndim) + " to " + reg[1].box.to_string() + " strides " +
                            strides_str(reg[1].strides, box.ndim);
  if (!in_bounds) return "a run out of bounds:" + where;
  std::vector<uint64_t> want(size[1] * eb, kSentinel);
  for_each_element(box, [&](const Index& idx) {
    for (int k = 0; k < eb; ++k) want[element_offset(reg[1], idx) * eb + k] = byte_tag(0, linear_index(shape, idx), k);
  });
  for (size_t k = 0; k < want.size(); ++k) {
    if (to[k] != want[k]) return "byte " + std::to_string(k) + " differs:" + where;
    if (w[k] != (want[k] == kSentinel ? 0 : 1))
      return "byte " + std::to_string(k) + " written " + std::to_string(w[k]) + " times:" + where;
  }
  return "";
}

// Strides of `box` packed in the memory order `order` (outermost first).
Index packed_strides(const Box& box, const std::vector<int>& order) {
  Index s{};
  int64_t acc = 1;
  for (int i = static_cast<int>(order.size()) - 1; i >= 0; --i) {
    s[order[i]] = acc;
    acc *= box.size[order[i]];
  }
  return s;
}

TEST(PlanProperty, ForEachCopyMatchesElementwise) {
  Rng r(0xc0b1'0000);
  int64_t cases = 0, copies = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::vector<int64_t> shape = random_shape_any(r, 800);
    const int eb = std::array<int, 4>{1, 2, 4, 8}[r.uni(0, 3)];
    // Two regions of the tensor in two buffers, random strides and offsets.
    Region reg[2];
    int64_t size[2];
    for (auto k = 0; k < 2; ++k) {
      reg[k].box = random_sub_box(r, shape);
      for (int tries = 0; k == 1 && tries < 20 && !overlaps(reg[0].box, reg[1].box); ++tries)
        reg[k].box = random_sub_box(r, shape);
      int64_t extent;
      reg[k].strides = random_strides(r, reg[k].box, &extent);
      reg[k].offset = r.uni(0, 5);
      size[k] = reg[k].offset + extent + r.uni(0, 3);
    }
    Box box = intersect(reg[0].box, reg[1].box);
    if (box.empty()) continue;
    // A random sub-box of the intersection.
    for (int d = 0; d < box.ndim; ++d) {
      const int64_t s = box.start[d] + r.uni(0, static_cast<int>(box.size[d]) - 1);
      const int64_t e = r.uni(static_cast<int>(s) + 1, static_cast<int>(box.end(d)));
      box.start[d] = s;
      box.size[d] = e - s;
    }
    int64_t runs = 0;
    const std::string diff = copy_mismatch(shape, box, reg, size, eb, &runs);
    ASSERT_EQ(diff, "") << "case " << i;
    copies += runs;
    ++cases;
  }
  std::cout << "[ copy     ] " << cases << " box copies, " << copies << " runs checked element by element\n";
}

// Two regions that order their dims the same way in memory (any permutation,
// padded or packed): the copy walks that order, so its runs are as long as
// the dims contiguous in both make them, and the bytes land as an element-
// by-element copy puts them.
TEST(PlanProperty, ForEachCopyWalksASharedMemoryOrder) {
  Rng r(0xc0b1'0001);
  int64_t cases = 0, one_run = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::vector<int64_t> shape = random_shape_any(r, 800);
    const int nd = static_cast<int>(shape.size());
    const int eb = std::array<int, 4>{1, 2, 4, 8}[r.uni(0, 3)];
    std::vector<int> order(nd);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), r.g);
    Region reg[2];
    int64_t size[2];
    for (int k = 0; k < 2; ++k) {
      // The whole tensor or a sub-box of it, packed in `order`; sometimes
      // with a gap after the innermost dim.
      reg[k].box = r.coin(0.5) ? Box::whole(shape) : random_sub_box(r, shape);
      if (k == 1 && !overlaps(reg[0].box, reg[1].box)) reg[1].box = reg[0].box;
      reg[k].strides = packed_strides(reg[k].box, order);
      if (nd > 1 && r.coin(0.2))
        for (int d = 0; d < nd; ++d)
          if (d != order[nd - 1]) reg[k].strides[d] = reg[k].strides[d] / reg[k].box.size[order[nd - 1]] *
                                                      (reg[k].box.size[order[nd - 1]] + 1);
      int64_t extent = 1;
      for (int d = 0; d < nd; ++d) extent += (reg[k].box.size[d] - 1) * reg[k].strides[d];
      reg[k].offset = r.uni(0, 5);
      size[k] = reg[k].offset + extent;
    }
    const Box box = intersect(reg[0].box, reg[1].box);
    if (box.empty()) continue;
    int64_t runs = 0;
    const std::string diff = copy_mismatch(shape, box, reg, size, eb, &runs);
    ASSERT_EQ(diff, "") << "case " << i << " order " << ::testing::PrintToString(order);
    // The run count: one run per index of the dims outside the longest
    // innermost stretch (in `order`, dims of one index skipped) that is
    // packed in both buffers.
    std::vector<int> walk;
    for (int d : order)
      if (box.size[d] > 1) walk.push_back(d);
    int64_t run = 1;
    int outer = static_cast<int>(walk.size());
    while (outer > 0 && reg[0].strides[walk[outer - 1]] == run && reg[1].strides[walk[outer - 1]] == run) {
      run *= box.size[walk[outer - 1]];
      --outer;
    }
    EXPECT_EQ(runs, box.numel() / run) << "case " << i << " box " << box.to_string();
    one_run += runs == 1;
    ++cases;
  }
  std::cout << "[ order    ] " << cases << " copies in a shared memory order checked, " << one_run
            << " of them one run\n";
}

// A tensor column-major in both buffers (strides [1, rows]): one run per
// column of a block of rows, one run for the whole tensor; before, one run
// per element.
TEST(PlanProperty, ColumnMajorOnBothSidesCopiesColumnsAsRuns) {
  const std::vector<int64_t> shape{64, 48};
  const Box whole = Box::whole(shape);
  Region reg[2];
  int64_t size[2];
  for (int k = 0; k < 2; ++k) {
    reg[k].box = whole;
    reg[k].strides = packed_strides(whole, {1, 0});
    size[k] = whole.numel();
  }
  int64_t runs = 0;
  EXPECT_EQ(copy_mismatch(shape, whole, reg, size, 2, &runs), "");
  EXPECT_EQ(runs, 1);
  Box rows = whole;  // rows [16, 48): a run per column
  rows.start[0] = 16;
  rows.size[0] = 32;
  EXPECT_EQ(copy_mismatch(shape, rows, reg, size, 2, &runs), "");
  EXPECT_EQ(runs, rows.numel() / 32);
  // The receiver holds rows [16, 48) column-major, packed (strides [1, 32]).
  reg[1].box = rows;
  reg[1].strides = packed_strides(rows, {1, 0});
  size[1] = rows.numel();
  EXPECT_EQ(copy_mismatch(shape, rows, reg, size, 2, &runs), "");
  EXPECT_EQ(runs, 48);
  // Row-major source, column-major receiver: the orders differ, one element
  // per run (the relayout of docs/refresh.md is what avoids that on the wire).
  reg[0].strides = packed_strides(whole, {0, 1});
  EXPECT_EQ(copy_mismatch(shape, rows, reg, size, 2, &runs), "");
  EXPECT_EQ(runs, rows.numel());
}

// ---------------------------------------------------------------------------
// DTensor expansion against its own brute force.

TEST(Placement, MatchesBruteForceOwners) {
  Rng r(0xd7e0'0000);
  int64_t accepted = 0, refused = 0, elements = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::vector<int64_t> shape = random_shape_any(r, 700);
    const int nd = static_cast<int>(shape.size());
    const int64_t mesh_size = r.uni(1, 12);
    const std::vector<int64_t> mesh = random_mesh(r, mesh_size);
    const std::vector<Placement> ps = random_placements(r, mesh, nd, r.coin(0.7));
    std::string pstr;
    for (const auto& p : ps) pstr += p.to_string() + " ";
    std::string mstr;
    for (int64_t m : mesh) mstr += std::to_string(m) + " ";
    const std::string ctx = "case " + std::to_string(i) + ": shape " + Box::whole(shape).to_string() + " mesh [" +
                            mstr + "] placements [" + pstr + "]";

    Layout L;
    L.sources.assign(mesh_size + 1, {0});
    const uint32_t t = L.add_tensor("w", DType::kBF16, shape);
    std::vector<int32_t> ranks(mesh_size);
    std::iota(ranks.begin(), ranks.end(), 1);  // rank 0 is left out of the mesh
    std::shuffle(ranks.begin(), ranks.end(), r.g);
    const DTensorSpec spec{mesh, ranks, ps};
    const auto order = reference_order(mesh, ps, nd);
    const Status st = add_dtensor(L, t, Side::kSource, spec, "w");
    const auto boxes = dtensor_boxes(shape, spec);
    ASSERT_EQ(st.is_ok(), order.has_value()) << ctx << ": add_dtensor says " << st.message();
    ASSERT_EQ(boxes.is_ok(), order.has_value()) << ctx;
    if (!order) {
      ++refused;
      continue;
    }
    ++accepted;
    ASSERT_TRUE(validate(L).is_ok()) << ctx;

    // Owners of every element by brute force: rank at mesh position p owns
    // idx iff every tensor dim's chain of chunks keeps idx[d].
    const int64_t n = numel_of(shape);
    std::vector<std::vector<int32_t>> want(n);
    std::vector<Box> bbox(mesh_size);  // bounding box of each position's elements
    std::vector<int64_t> count(mesh_size, 0);
    std::vector<int64_t> coord(mesh.size(), 0);
    for (int64_t pos = 0; pos < mesh_size; ++pos) {
      Box bb;
      bb.ndim = nd;
      for (int d = 0; d < nd; ++d) bb.start[d] = shape[d];
      Index hi{};
      for_each_element(Box::whole(shape), [&](const Index& idx) {
        for (int d = 0; d < nd; ++d)
          if (!owns_along(mesh, *order, coord, d, shape[d], idx[d])) return;
        want[linear_index(shape, idx)].push_back(ranks[pos]);
        ++count[pos];
        for (int d = 0; d < nd; ++d) {
          bb.start[d] = std::min(bb.start[d], idx[d]);
          hi[d] = std::max(hi[d], idx[d] + 1);
        }
      });
      if (count[pos] > 0) {
        for (int d = 0; d < nd; ++d) bb.size[d] = hi[d] - bb.start[d];
        ASSERT_EQ(bb.numel(), count[pos]) << ctx << ": reference shard of position " << pos << " is not a box";
      } else {
        bb = Box{};
        bb.ndim = nd;
      }
      bbox[pos] = bb;
      for (int m = static_cast<int>(mesh.size()) - 1; m >= 0; --m) {
        if (++coord[m] < mesh[m]) break;
        coord[m] = 0;
      }
    }
    for (auto& w : want) std::sort(w.begin(), w.end());

    // dtensor_boxes: one box per mesh position, the reference's shard.
    ASSERT_EQ(boxes->size(), static_cast<size_t>(mesh_size)) << ctx;
    for (int64_t pos = 0; pos < mesh_size; ++pos) {
      if (count[pos] == 0) {
        EXPECT_TRUE((*boxes)[pos].empty()) << ctx << ": position " << pos << " gets " << (*boxes)[pos].to_string();
      } else {
        EXPECT_EQ((*boxes)[pos], bbox[pos]) << ctx << ": position " << pos << " gets " << (*boxes)[pos].to_string()
                                            << ", reference " << bbox[pos].to_string();
      }
    }

    // add_dtensor: owners from the regions, buffers row-major and exact.
    std::vector<std::vector<int32_t>> got(n);
    std::vector<int> regions_of_rank(mesh_size + 1, 0);
    for (const Region& reg : L.tensors[t].sources) {
      const auto& rs = L.source_sets.get(reg.ranks);
      const Buffer& b = L.buffers[reg.buffer];
      std::vector<int64_t> local(reg.box.size.begin(), reg.box.size.begin() + nd);
      EXPECT_EQ(b.name, "w") << ctx;
      EXPECT_EQ(b.side, Side::kSource) << ctx;
      EXPECT_EQ(b.ranks, reg.ranks) << ctx << ": buffer and region rank sets differ";
      EXPECT_EQ(b.bytes, reg.box.numel() * 2) << ctx;
      EXPECT_EQ(reg.offset, 0) << ctx;
      EXPECT_EQ(reg.strides, row_major_strides(local)) << ctx;
      for (int32_t x : rs) {
        ++regions_of_rank[x];
        // The rank's position in the mesh; its reference shard must be this box.
        const int64_t pos = std::find(ranks.begin(), ranks.end(), x) - ranks.begin();
        ASSERT_LT(pos, mesh_size) << ctx << ": rank " << x << " is not in the mesh";
        EXPECT_EQ(reg.box, bbox[pos]) << ctx << ": rank " << x;
      }
      for_each_element(reg.box, [&](const Index& idx) {
        for (int32_t x : rs) got[linear_index(shape, idx)].push_back(x);
      });
    }
    for (int64_t pos = 0; pos < mesh_size; ++pos)
      EXPECT_EQ(regions_of_rank[ranks[pos]], count[pos] > 0 ? 1 : 0)
          << ctx << ": rank " << ranks[pos] << " (position " << pos << ") has " << regions_of_rank[ranks[pos]]
          << " regions, reference shard has " << count[pos] << " elements";
    EXPECT_EQ(regions_of_rank[0], 0) << ctx;
    for (int64_t g = 0; g < n; ++g) {
      std::sort(got[g].begin(), got[g].end());
      ASSERT_EQ(got[g], want[g]) << ctx << ": owners of element " << g << " are " << ranks_str(got[g]) << ", reference "
                                 << ranks_str(want[g]);
    }
    elements += n;
  }
  std::cout << "[ dtensor  ] " << accepted << " specs expanded and checked (" << elements << " elements), " << refused
            << " refused as the reference refuses them\n";
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(refused, 50);
}

Box box_of(std::initializer_list<std::pair<int64_t, int64_t>> dims) {
  Box b;
  for (const auto& [lo, hi] : dims) {
    b.start[b.ndim] = lo;
    b.size[b.ndim] = hi - lo;
    ++b.ndim;
  }
  return b;
}

Placement shard(int d) { return Placement{Placement::Kind::kShard, d, 1}; }
Placement strided(int d, int k) { return Placement{Placement::Kind::kStridedShard, d, k}; }

// torch.chunk: 5 rows over 4 ranks are chunks of 2, 2, 1 and nothing.
TEST(Placement, TrailingShardsAreEmpty) {
  auto b = dtensor_boxes({5}, DTensorSpec{{4}, {0, 1, 2, 3}, {shard(0)}});
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_EQ((*b)[0], box_of({{0, 2}}));
  EXPECT_EQ((*b)[1], box_of({{2, 4}}));
  EXPECT_EQ((*b)[2], box_of({{4, 5}}));
  EXPECT_TRUE((*b)[3].empty());
  // Nested on one dim: chunk 5 in 3+2 first, then each in two.
  auto n = dtensor_boxes({5}, DTensorSpec{{2, 2}, {0, 1, 2, 3}, {shard(0), shard(0)}});
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ((*n)[0], box_of({{0, 2}}));
  EXPECT_EQ((*n)[1], box_of({{2, 3}}));
  EXPECT_EQ((*n)[2], box_of({{3, 4}}));
  EXPECT_EQ((*n)[3], box_of({{4, 5}}));
}

// FSDP2 over TP: mesh (dp=2, tp=2), [SS(0,2), S(0)]: TP cuts rows 0-7 in two,
// then FSDP cuts each TP half; (dp i, tp j) holds rows 4j + 2i .. +2.
TEST(Placement, StridedShardFollowsItsPairedShard) {
  auto b = dtensor_boxes({8, 2}, DTensorSpec{{2, 2}, {0, 1, 2, 3}, {strided(0, 2), shard(0)}});
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_EQ((*b)[0], box_of({{0, 2}, {0, 2}}));
  EXPECT_EQ((*b)[1], box_of({{4, 6}, {0, 2}}));
  EXPECT_EQ((*b)[2], box_of({{2, 4}, {0, 2}}));
  EXPECT_EQ((*b)[3], box_of({{6, 8}, {0, 2}}));
  // PyTorch's docstring example: [S(0), SS(0,2), S(0)] orders mesh dims 0, 2, 1.
  auto c = dtensor_boxes({8}, DTensorSpec{{2, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7}, {shard(0), strided(0, 2), shard(0)}});
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  // position (a, b, c) -> rows 4a + 2c + b
  for (int a = 0; a < 2; ++a)
    for (int bb = 0; bb < 2; ++bb)
      for (int cc = 0; cc < 2; ++cc)
        EXPECT_EQ((*c)[a * 4 + bb * 2 + cc], box_of({{4 * a + 2 * cc + bb, 4 * a + 2 * cc + bb + 1}}));
  // Refused: a wrong split factor, a strided shard with nothing to pair with,
  // and a plain shard after the strided part ended.
  EXPECT_FALSE(dtensor_boxes({8}, DTensorSpec{{2, 2}, {0, 1, 2, 3}, {strided(0, 3), shard(0)}}).is_ok());
  EXPECT_FALSE(dtensor_boxes({8}, DTensorSpec{{2, 2}, {0, 1, 2, 3}, {shard(0), strided(0, 2)}}).is_ok());
  EXPECT_FALSE(dtensor_boxes({8}, DTensorSpec{{2, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7}, {strided(0, 2), shard(0), shard(0)}})
                   .is_ok());
}


// ---------------------------------------------------------------------------
// Layouts the recipes make (fused buffers, vocabulary padding, expert
// parallelism, FSDP's shared region lists), planned and executed against the
// same reference.

Manifest tiny_model(bool moe) {
  Manifest m;
  auto add = [&](std::string name, std::vector<int64_t> shape) { m.push_back({std::move(name), DType::kBF16, shape}); };
  const int64_t hidden = 16, heads = 4, kv = 2, hd = 4, inter = 24, vocab = 50, experts = 4, moe_inter = 8;
  add("model.embed_tokens.weight", {vocab, hidden});
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    add(p + ".input_layernorm.weight", {hidden});
    add(p + ".self_attn.q_proj.weight", {heads * hd, hidden});
    add(p + ".self_attn.k_proj.weight", {kv * hd, hidden});
    add(p + ".self_attn.v_proj.weight", {kv * hd, hidden});
    add(p + ".self_attn.o_proj.weight", {hidden, heads * hd});
    add(p + ".self_attn.q_norm.weight", {hd});
    add(p + ".self_attn.k_norm.weight", {hd});
    add(p + ".post_attention_layernorm.weight", {hidden});
    if (!moe) {
      add(p + ".mlp.gate_proj.weight", {inter, hidden});
      add(p + ".mlp.up_proj.weight", {inter, hidden});
      add(p + ".mlp.down_proj.weight", {hidden, inter});
      continue;
    }
    add(p + ".mlp.gate.weight", {experts, hidden});
    for (int e = 0; e < experts; ++e) {
      const std::string q = p + ".mlp.experts." + std::to_string(e);
      add(q + ".gate_proj.weight", {moe_inter, hidden});
      add(q + ".up_proj.weight", {moe_inter, hidden});
      add(q + ".down_proj.weight", {hidden, moe_inter});
    }
  }
  add("model.norm.weight", {hidden});
  add("lm_head.weight", {vocab, hidden});
  m.config.origin = "tiny.config.json";
  m.config.num_attention_heads = heads;
  m.config.num_key_value_heads = kv;
  m.config.head_dim = hd;
  m.config.vocab_size = vocab;
  m.config.tie_word_embeddings = false;
  if (moe) {
    m.config.num_experts = experts;
    m.config.moe_intermediate_size = moe_inter;
  }
  return m;
}

TEST(PlanProperty, RecipeLayoutsExecuteExactly) {
  struct Case {
    const char* name;
    bool moe;
    TrainSide train;
    InferSide infer;
  };
  const Case cases[] = {
      {"fsdp dp4 -> tp2 x2", false, {4, 1, 1, 4, 1, 1, true, 4}, {4, 2, 2, 1, false, 4}},
      {"fsdp tp2 dp2 -> tp2 x2, two domains", false, {4, 2, 1, 2, 1, 1, true, 2}, {4, 2, 2, 1, false, 2}},
      {"megatron tp2 pp2 dp2 -> tp2 pp2", false, {8, 2, 1, 2, 2, 1, false, 4}, {4, 2, 1, 2, false, 4}},
      {"megatron tp1 dp4 ep2 -> tp2 x2 ep", true, {4, 1, 1, 4, 1, 2, false, 4}, {4, 2, 2, 1, true, 2}},
      {"megatron tp2 dp2 ep2 -> tp4", true, {4, 2, 1, 2, 1, 2, false, 4}, {4, 4, 1, 1, false, 4}},
  };
  for (const Case& c : cases) {
    Scenario s;
    s.model = "tiny";
    s.train = c.train;
    s.infer = c.infer;
    auto L = layout_from_scenario(s, tiny_model(c.moe));
    ASSERT_TRUE(L.is_ok()) << c.name << ": " << L.status().message();
    ASSERT_TRUE(validate(*L).is_ok()) << c.name << ": " << validate(*L).message();
    const Reference R = make_reference(*L);
    for (Strategy st : {Strategy::kRefit, Strategy::kNoDedup}) {
      auto plan = make_plan(*L, {st, 256});
      ASSERT_TRUE(plan.is_ok()) << c.name << ": " << plan.status().message();
      // Planned on threads, a range of the model's tensors each: the same
      // plan, pull set ids and all.
      for (int threads : {2, 3, 7}) {
        PlanOptions o{st, 256};
        o.threads = threads;
        auto again = make_plan(*L, o);
        ASSERT_TRUE(again.is_ok()) << c.name << ": " << again.status().message();
        EXPECT_EQ(plan_difference(*plan, collect_runs(*plan), *again, collect_runs(*again)), "")
            << c.name << " (" << strategy_name(st) << ") on " << threads << " threads";
      }
      Violations v;
      SimTotals tot;
      check_plan(R, *plan, collect_runs(*plan), v, tot);
      for (const auto& [name, e] : v.by_property) ADD_FAILURE() << c.name << " (" << strategy_name(st) << "): " << v.report(name);
      EXPECT_GT(tot.runs, 0) << c.name;
    }
  }
}

}  // namespace
}  // namespace refit
