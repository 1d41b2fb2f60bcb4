#include "planner/plan.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <exception>
#include <numeric>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "planner/cores.h"

namespace refit {

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::kRefit: return "refit";
    case Strategy::kNoDedup: return "no-dedup";
    case Strategy::kBroadcast: return "broadcast";
  }
  return "?";
}

SourcePick Plan::source(const Unit& u, size_t i) const {
  const PullSet& s = pull_sets_[u.pull_set];
  if (s.forced) {
    const Piece& p = s.pieces[i];
    const uint32_t region = s.holders[p.holders_begin];
    const Region& r = layout_->tensors[u.tensor].sources[region];
    return {layout_->source_sets.get(r.ranks).front(), region};
  }
  return chosen_[u.sources_begin + i];
}

namespace {

struct BoxHash {
  size_t operator()(const Box& b) const {
    uint64_t h = static_cast<uint64_t>(b.ndim) * 0x9E3779B97F4A7C15ull;
    for (int d = 0; d < b.ndim; ++d) {
      h = (h ^ static_cast<uint64_t>(b.start[d])) * 0x100000001B3ull;
      h = (h ^ static_cast<uint64_t>(b.size[d])) * 0x100000001B3ull;
    }
    return static_cast<size_t>(h);
  }
};

struct VecHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct PairHash {
  size_t operator()(const std::pair<uint32_t, Box>& k) const {
    return BoxHash()(k.second) * 31 + k.first;
  }
};

// Interns small sorted lists of indices; id 0 is the empty list.
class ListInterner {
 public:
  ListInterner() { ids_.emplace(std::vector<int64_t>{}, 0); lists_.emplace_back(); }
  uint32_t intern(const std::vector<int64_t>& v) {
    auto [it, inserted] = ids_.emplace(v, static_cast<uint32_t>(lists_.size()));
    if (inserted) lists_.push_back(v);
    return it->second;
  }
  const std::vector<int64_t>& get(uint32_t id) const { return lists_[id]; }
  uint32_t size() const { return static_cast<uint32_t>(lists_.size()); }
  void clear() {
    ids_.clear();
    lists_.clear();
    ids_.emplace(std::vector<int64_t>{}, 0);
    lists_.emplace_back();
  }

 private:
  std::unordered_map<std::vector<int64_t>, uint32_t, VecHash> ids_;
  std::vector<std::vector<int64_t>> lists_;
};

// Coordinate compression of `boxes` clipped to `within`: per dim the sorted
// distinct cut points. The grid cell (i0, i1, ..) is the box between cuts.
struct Grid {
  int ndim = 0;
  std::vector<int64_t> cuts[kMaxDims];
  int64_t cells = 0;
  Index extent{};  // cells per dim
  Index stride{};  // row-major cell index stride per dim

  void build(const Box& within, const std::vector<const Box*>& boxes) {
    ndim = within.ndim;
    cells = 1;
    for (int d = 0; d < ndim; ++d) {
      auto& c = cuts[d];
      c.clear();
      c.push_back(within.start[d]);
      c.push_back(within.end(d));
      for (const Box* b : boxes) {
        if (b->start[d] > within.start[d] && b->start[d] < within.end(d)) c.push_back(b->start[d]);
        if (b->end(d) > within.start[d] && b->end(d) < within.end(d)) c.push_back(b->end(d));
      }
      std::sort(c.begin(), c.end());
      c.erase(std::unique(c.begin(), c.end()), c.end());
      extent[d] = static_cast<int64_t>(c.size()) - 1;
    }
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      stride[d] = s;
      s *= extent[d];
    }
    cells = s;
  }
  // Cell index range [lo, hi) per dim covered by `b` (which is aligned to cuts).
  void range(const Box& b, Index* lo, Index* hi) const {
    for (int d = 0; d < ndim; ++d) {
      const auto& c = cuts[d];
      const int64_t s = std::max(b.start[d], c.front());
      const int64_t e = std::min(b.end(d), c.back());
      (*lo)[d] = std::lower_bound(c.begin(), c.end(), s) - c.begin();
      (*hi)[d] = e <= s ? (*lo)[d] : std::lower_bound(c.begin(), c.end(), e) - c.begin();
    }
  }
  Box to_box(const Index& lo, const Index& hi) const {
    Box b;
    b.ndim = ndim;
    for (int d = 0; d < ndim; ++d) {
      b.start[d] = cuts[d][lo[d]];
      b.size[d] = cuts[d][hi[d]] - cuts[d][lo[d]];
    }
    return b;
  }
};

// Calls fn(cell index) for every cell in [lo, hi).
template <typename F>
void for_cells(const Grid& g, const Index& lo, const Index& hi, F&& fn) {
  for (int d = 0; d < g.ndim; ++d)
    if (hi[d] <= lo[d]) return;
  Index idx = lo;
  for (;;) {
    int64_t c = 0;
    for (int d = 0; d < g.ndim; ++d) c += idx[d] * g.stride[d];
    fn(c);
    int d = g.ndim - 1;
    while (d >= 0) {
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
      --d;
    }
    if (d < 0) break;
  }
}

// Greedy merge of cells with equal non-zero signature into maximal boxes:
// scan cells row-major; from each unassigned cell grow along the last dim,
// then along each earlier dim while the whole slab matches. Deterministic.
template <typename Sig, typename F>
void merge_cells(const Grid& g, std::vector<Sig>& sig, F&& emit) {
  std::vector<bool> done(g.cells, false);
  Index idx{};
  for (int64_t c = 0; c < g.cells; ++c) {
    // idx = coordinates of c
    int64_t rem = c;
    for (int d = 0; d < g.ndim; ++d) {
      idx[d] = rem / g.stride[d];
      rem %= g.stride[d];
    }
    if (done[c] || sig[c] == 0) continue;
    const Sig s = sig[c];
    Index lo = idx, hi = idx;
    for (int d = 0; d < g.ndim; ++d) hi[d] = idx[d] + 1;
    for (int d = g.ndim - 1; d >= 0; --d) {
      while (hi[d] < g.extent[d]) {
        Index slo = lo, shi = hi;
        slo[d] = hi[d];
        shi[d] = hi[d] + 1;
        bool ok = true;
        for_cells(g, slo, shi, [&](int64_t x) { ok = ok && !done[x] && sig[x] == s; });
        if (!ok) break;
        hi[d] += 1;
      }
    }
    for_cells(g, lo, hi, [&](int64_t x) { done[x] = true; });
    emit(lo, hi, s);
  }
}

// Whether copying `box` from `from` to `to` is one contiguous run (the
// merge of for_each_copy covers every dim of the box that has more than
// one element).
bool contiguous_copy(const Box& box, const Region& from, const Region& to) {
  const CopyOrder o = copy_order(box, from, to);
  for (int i = 0; i < o.outer; ++i) {
    if (box.size[o.dims[i]] > 1) return false;
  }
  return true;
}

int64_t count_chunks(const Box& box, int64_t max_elems) {
  if (box.empty()) return 0;
  if (box.numel() <= max_elems) return 1;
  int k = box.ndim - 1;
  int64_t inner = 1;
  while (k >= 0 && inner * box.size[k] <= max_elems) {
    inner *= box.size[k];
    --k;
  }
  const int64_t step = max_elems / inner;
  int64_t n = (box.size[k] + step - 1) / step;
  for (int d = 0; d < k; ++d) n *= box.size[d];
  return n;
}

// Per rank set: its ranks grouped by receiving domain, cached.
struct DomainSplit {
  struct Part {
    int32_t domain;
    uint32_t begin, count;  // into ranks
  };
  std::vector<Part> parts;
  std::vector<int32_t> ranks;
};

class Planner {
 public:
  Planner(const Layout& L, const PlanOptions& o, std::vector<Unit>* units, std::vector<Consumer>* consumers,
          std::vector<PullSet>* pull_sets)
      : L_(L), opt_(o), units_(*units), consumers_(*consumers), pull_sets_(*pull_sets) {
    splits_.resize(L.receiver_sets.size());
    split_done_.assign(L.receiver_sets.size(), false);
  }

  Status plan_tensor(uint32_t ti) {
    const Tensor& t = L_.tensors[ti];
    // A derived tensor (block scales) is computed by the receivers, not moved.
    if (t.receivers.empty() || t.derived_from >= 0) return Status::ok();
    source_sig_ = source_signature(t);
    // (domain, region, part) entries, grouped by domain.
    entries_.clear();
    for (uint32_t ri = 0; ri < t.receivers.size(); ++ri) {
      const DomainSplit& s = split(t.receivers[ri].ranks);
      for (uint32_t pi = 0; pi < s.parts.size(); ++pi) entries_.push_back({s.parts[pi].domain, ri, pi});
    }
    std::stable_sort(entries_.begin(), entries_.end(),
                     [](const Entry& a, const Entry& b) { return a.domain < b.domain; });
    for (size_t i = 0; i < entries_.size();) {
      size_t j = i;
      while (j < entries_.size() && entries_[j].domain == entries_[i].domain) ++j;
      REFIT_RETURN_IF_ERROR(plan_domain(ti, i, j));
      i = j;
    }
    return Status::ok();
  }

 private:
  struct Entry {
    int32_t domain;
    uint32_t region;
    uint32_t part;
  };

  const DomainSplit& split(RankSetId id) {
    if (split_done_[id]) return splits_[id];
    DomainSplit& s = splits_[id];
    std::vector<std::pair<int32_t, int32_t>> dr;  // (domain, rank)
    for (int32_t r : L_.receiver_sets.get(id))
      dr.push_back({opt_.strategy == Strategy::kNoDedup ? r : L_.receivers[r].domain, r});
    std::sort(dr.begin(), dr.end());
    for (size_t i = 0; i < dr.size(); ++i) {
      if (i == 0 || dr[i].first != dr[i - 1].first)
        s.parts.push_back({dr[i].first, static_cast<uint32_t>(s.ranks.size()), 0});
      s.ranks.push_back(dr[i].second);
      s.parts.back().count++;
    }
    split_done_[id] = true;
    return s;
  }

  // Tensors that share a region list share the signature: looked up by the
  // list's identity, so 70k FSDP tensors do not rehash 256 regions each.
  uint32_t source_signature(const Tensor& t) {
    auto [it, fresh] = sig_of_list_.emplace(t.sources.id(), 0);
    if (!fresh) return it->second;
    it->second = source_signature_of(t);
    return it->second;
  }

  uint32_t source_signature_of(const Tensor& t) {
    key_.clear();
    for (const Region& r : t.sources) {
      key_.push_back(r.ranks);
      for (int d = 0; d < r.box.ndim; ++d) {
        key_.push_back(r.box.start[d]);
        key_.push_back(r.box.size[d]);
      }
    }
    key_.push_back(static_cast<int64_t>(t.shape.size()));
    return source_sigs_.intern(key_);
  }

  Status plan_domain(uint32_t ti, size_t b, size_t e) {
    const Tensor& t = L_.tensors[ti];
    const int32_t domain = entries_[b].domain;
    // `members`: offsets k - b of the entries (regions of this domain) that
    // consume the unit.
    auto emit_unit = [&](const Box& box, const std::vector<uint32_t>& members) -> Status {
      Unit u;
      u.tensor = ti;
      u.domain = domain;
      u.consumers_begin = static_cast<uint32_t>(consumers_.size());
      for (uint32_t m : members) {
        const Entry& en = entries_[b + m];
        const DomainSplit& s = split(t.receivers[en.region].ranks);
        const DomainSplit::Part& p = s.parts[en.part];
        for (uint32_t q = 0; q < p.count; ++q) consumers_.push_back({s.ranks[p.begin + q], en.region});
      }
      if (members.size() > 1)
        std::sort(consumers_.begin() + u.consumers_begin, consumers_.end(), [](const Consumer& x, const Consumer& y) {
          return x.rank != y.rank ? x.rank < y.rank : x.region < y.region;
        });
      u.consumers_count = static_cast<uint32_t>(consumers_.size() - u.consumers_begin);
      auto ps = pull_set(t, box);
      if (!ps) {
        const Consumer& c = consumers_[u.consumers_begin];
        consumers_.resize(u.consumers_begin);
        return Status::invalid("receiver rank " + std::to_string(c.rank) + " needs tensor \"" + t.name + "\" box " +
                               ps.status().message() + ", which no source holds");
      }
      u.pull_set = *ps;
      units_.push_back(u);
      return Status::ok();
    };

    members_.clear();
    if (e - b == 1) {
      // One region: the unit is its box.
      members_.push_back(0);
      return emit_unit(t.receivers[entries_[b].region].box, members_);
    }
    boxes_.clear();
    for (size_t k = b; k < e; ++k) boxes_.push_back(&t.receivers[entries_[k].region].box);
    grid_.build(Box::whole(t.shape), boxes_);
    Status st;
    if (e - b <= 64) {
      // Signatures as bit masks of the domain's entries: no allocation.
      masks_.assign(grid_.cells, 0);
      for (size_t k = b; k < e; ++k) {
        Index lo, hi;
        grid_.range(t.receivers[entries_[k].region].box, &lo, &hi);
        const uint64_t bit = uint64_t{1} << (k - b);
        for_cells(grid_, lo, hi, [&](int64_t c) { masks_[c] |= bit; });
      }
      merge_cells(grid_, masks_, [&](const Index& lo, const Index& hi, uint64_t mask) {
        if (!st.is_ok()) return;
        members_.clear();
        for (uint64_t left = mask; left != 0; left &= left - 1)
          members_.push_back(static_cast<uint32_t>(std::countr_zero(left)));
        st = emit_unit(grid_.to_box(lo, hi), members_);
      });
      return st;
    }
    cell_lists_.assign(grid_.cells, {});
    for (size_t k = b; k < e; ++k) {
      Index lo, hi;
      grid_.range(t.receivers[entries_[k].region].box, &lo, &hi);
      for_cells(grid_, lo, hi, [&](int64_t c) { cell_lists_[c].push_back(static_cast<int64_t>(k - b)); });
    }
    sigs_.clear();
    sig_.resize(grid_.cells);
    for (int64_t c = 0; c < grid_.cells; ++c) sig_[c] = sigs_.intern(cell_lists_[c]);
    merge_cells(grid_, sig_, [&](const Index& lo, const Index& hi, uint32_t sig) {
      if (!st.is_ok()) return;
      members_.assign(sigs_.get(sig).begin(), sigs_.get(sig).end());
      st = emit_unit(grid_.to_box(lo, hi), members_);
    });
    return st;
  }

  // The pieces of `box` by holders, interned per (source signature, box).
  // On failure the message is the box that no source holds.
  Result<uint32_t> pull_set(const Tensor& t, const Box& box) {
    auto key = std::make_pair(source_sig_, box);
    auto it = pull_cache_.find(key);
    if (it != pull_cache_.end()) return it->second;
    PullSet ps;
    ps.box = box;
    // Fast path: regions that contain the whole box, and none that cut it.
    bool cut = false;
    std::vector<uint32_t> full;
    for (uint32_t i = 0; i < t.sources.size(); ++i) {
      const Box& sb = t.sources[i].box;
      if (contains(sb, box)) full.push_back(i);
      else if (overlaps(sb, box)) cut = true;
    }
    if (!cut && !full.empty()) {
      ps.holders = full;
      ps.pieces.push_back({box, 0, static_cast<uint32_t>(full.size())});
    } else {
      std::vector<const Box*> sboxes;
      std::vector<uint32_t> sidx;
      for (uint32_t i = 0; i < t.sources.size(); ++i)
        if (overlaps(t.sources[i].box, box)) {
          sboxes.push_back(&t.sources[i].box);
          sidx.push_back(i);
        }
      Grid g;
      g.build(box, sboxes);
      std::vector<std::vector<int64_t>> lists(g.cells);
      for (size_t k = 0; k < sboxes.size(); ++k) {
        Index lo, hi;
        g.range(intersect(*sboxes[k], box), &lo, &hi);
        for_cells(g, lo, hi, [&](int64_t c) { lists[c].push_back(sidx[k]); });
      }
      ListInterner sigs;
      std::vector<uint32_t> sig(g.cells);
      for (int64_t c = 0; c < g.cells; ++c) {
        sig[c] = sigs.intern(lists[c]);
        if (sig[c] == 0) {
          Index lo{}, hi{};
          int64_t rem = c;
          for (int d = 0; d < g.ndim; ++d) {
            lo[d] = rem / g.stride[d];
            rem %= g.stride[d];
            hi[d] = lo[d] + 1;
          }
          return Status::invalid(g.to_box(lo, hi).to_string());
        }
      }
      merge_cells(g, sig, [&](const Index& lo, const Index& hi, uint32_t s) {
        const auto& h = sigs.get(s);
        Piece p{g.to_box(lo, hi), static_cast<uint32_t>(ps.holders.size()), static_cast<uint32_t>(h.size())};
        for (int64_t x : h) ps.holders.push_back(static_cast<uint32_t>(x));
        ps.pieces.push_back(p);
      });
    }
    // Forced when every piece has exactly one holder rank.
    ps.forced = true;
    for (const Piece& p : ps.pieces) {
      int32_t only = -1;
      for (uint32_t k = 0; k < p.holders_count && ps.forced; ++k) {
        for (int32_t r : L_.source_sets.get(t.sources[ps.holders[p.holders_begin + k]].ranks)) {
          if (only == -1) only = r;
          else if (r != only) { ps.forced = false; break; }
        }
      }
    }
    const uint32_t id = static_cast<uint32_t>(pull_sets_.size());
    pull_sets_.push_back(std::move(ps));
    pull_set_sig_.push_back(source_sig_);
    pull_cache_.emplace(key, id);
    return id;
  }

 public:
  // Appends what `other` planned (its units, consumers and pull sets, of
  // the tensors after this planner's) as if this planner had planned those
  // tensors itself: a pull set this planner already has, by source
  // signature and box, is shared, and the others take the next ids in the
  // order `other` made them, which is the order of their first use. So
  // planners of consecutive ranges of tensors, adopted in order, give the
  // plan one planner gives (plan_units).
  void adopt(Planner& other) {
    std::vector<uint32_t> sig(other.source_sigs_.size());
    for (uint32_t k = 0; k < sig.size(); ++k) sig[k] = source_sigs_.intern(other.source_sigs_.get(k));
    std::vector<uint32_t> id(other.pull_sets_.size());
    for (uint32_t i = 0; i < id.size(); ++i) {
      auto key = std::make_pair(sig[other.pull_set_sig_[i]], other.pull_sets_[i].box);
      auto [it, fresh] = pull_cache_.emplace(key, static_cast<uint32_t>(pull_sets_.size()));
      if (fresh) {
        pull_sets_.push_back(std::move(other.pull_sets_[i]));
        pull_set_sig_.push_back(key.first);
      }
      id[i] = it->second;
    }
    std::vector<PullSet>().swap(other.pull_sets_);
    // The consumers (hundreds of megabytes on DeepSeek-V3 at 4096 ranks)
    // are copied beside the units.
    const auto base = static_cast<uint32_t>(consumers_.size());
    std::exception_ptr failed;
    auto copy_consumers = [&] {
      try {
        consumers_.insert(consumers_.end(), other.consumers_.begin(), other.consumers_.end());
        std::vector<Consumer>().swap(other.consumers_);
      } catch (...) {
        failed = std::current_exception();
      }
    };
    std::jthread beside;  // joined however this returns
    try {
      beside = std::jthread(copy_consumers);
    } catch (const std::system_error&) {
      copy_consumers();
    }
    units_.reserve(units_.size() + other.units_.size());
    for (Unit u : other.units_) {
      u.consumers_begin += base;
      u.pull_set = id[u.pull_set];
      units_.push_back(u);
    }
    std::vector<Unit>().swap(other.units_);
    if (beside.joinable()) beside.join();
    if (failed) std::rethrow_exception(failed);
  }

 private:
  const Layout& L_;
  const PlanOptions& opt_;
  std::vector<Unit>& units_;
  std::vector<Consumer>& consumers_;
  std::vector<PullSet>& pull_sets_;
  std::vector<DomainSplit> splits_;
  std::vector<bool> split_done_;
  std::vector<Entry> entries_;
  std::vector<const Box*> boxes_;
  Grid grid_;
  std::vector<std::vector<int64_t>> cell_lists_;
  std::vector<uint32_t> sig_;
  std::vector<uint64_t> masks_;
  std::vector<uint32_t> members_;
  ListInterner sigs_;
  ListInterner source_sigs_;
  std::vector<int64_t> key_;
  uint32_t source_sig_ = 0;
  std::unordered_map<const void*, uint32_t> sig_of_list_;
  std::unordered_map<std::pair<uint32_t, Box>, uint32_t, PairHash> pull_cache_;
  std::vector<uint32_t> pull_set_sig_;  // per pull set: its source signature
};

// Distinct bytes each receiving domain needs, summed: the least any plan can
// move over the network. Computed on its own, from the receiver regions only.
int64_t minimum_network_bytes(const Layout& L) {
  int64_t total = 0;
  std::vector<std::pair<int32_t, uint32_t>> dr;  // (domain, region)
  std::vector<const Box*> boxes;
  for (const Tensor& t : L.tensors) {
    if (t.derived_from >= 0) continue;
    dr.clear();
    for (uint32_t ri = 0; ri < t.receivers.size(); ++ri) {
      const auto& ranks = L.receiver_sets.get(t.receivers[ri].ranks);
      int32_t last = -1;
      std::vector<int32_t> doms;
      for (int32_t r : ranks) doms.push_back(L.receivers[r].domain);
      std::sort(doms.begin(), doms.end());
      for (int32_t d : doms)
        if (d != last) dr.push_back({last = d, ri});
    }
    std::sort(dr.begin(), dr.end());
    const int eb = dtype_bytes(t.dtype);
    for (size_t i = 0; i < dr.size();) {
      size_t j = i;
      boxes.clear();
      while (j < dr.size() && dr[j].first == dr[i].first) boxes.push_back(&t.receivers[dr[j++].second].box);
      Grid g;
      g.build(Box::whole(t.shape), boxes);
      std::vector<bool> covered(g.cells, false);
      for (const Box* b : boxes) {
        Index lo, hi;
        g.range(*b, &lo, &hi);
        for_cells(g, lo, hi, [&](int64_t c) { covered[c] = true; });
      }
      Index idx{};
      for (int64_t c = 0; c < g.cells; ++c) {
        if (!covered[c]) continue;
        int64_t rem = c, n = 1;
        for (int d = 0; d < g.ndim; ++d) {
          idx[d] = rem / g.stride[d];
          rem %= g.stride[d];
          n *= g.cuts[d][idx[d] + 1] - g.cuts[d][idx[d]];
        }
        total += n * eb;
      }
      i = j;
    }
  }
  return total;
}

void summarize_broadcast(const Layout& L, PlanSummary* s, std::vector<int64_t>* src_nic,
                         std::vector<int64_t>* rcv_nic) {
  // Largest tensor first; the gatherer is the least loaded source rank that
  // holds a part of it (ties to the lowest rank); every receiver rank that
  // needs any part pulls the whole tensor from it.
  std::vector<uint32_t> order(L.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return L.tensors[a].bytes() > L.tensors[b].bytes(); });
  for (uint32_t ti : order) {
    const Tensor& t = L.tensors[ti];
    if (t.receivers.empty()) continue;
    std::vector<int32_t> needers;
    for (const Region& r : t.receivers)
      for (int32_t x : L.receiver_sets.get(r.ranks)) needers.push_back(x);
    std::sort(needers.begin(), needers.end());
    needers.erase(std::unique(needers.begin(), needers.end()), needers.end());
    int32_t g = -1;
    for (const Region& r : t.sources)
      for (int32_t x : L.source_sets.get(r.ranks))
        if (g == -1 || (*src_nic)[x] < (*src_nic)[g] || ((*src_nic)[x] == (*src_nic)[g] && x < g)) g = x;
    if (g == -1) continue;  // make_plan reports the missing source through the refit plan
    std::vector<const Box*> own;
    for (const Region& r : t.sources) {
      const auto& rs = L.source_sets.get(r.ranks);
      if (std::binary_search(rs.begin(), rs.end(), g)) own.push_back(&r.box);
    }
    Grid grid;
    grid.build(Box::whole(t.shape), own);
    std::vector<bool> cov(grid.cells, false);
    for (const Box* b : own) {
      Index lo, hi;
      grid.range(*b, &lo, &hi);
      for_cells(grid, lo, hi, [&](int64_t c) { cov[c] = true; });
    }
    int64_t owned = 0;
    for (int64_t c = 0; c < grid.cells; ++c) {
      if (!cov[c]) continue;
      int64_t rem = c, n = 1;
      for (int d = 0; d < grid.ndim; ++d) {
        int64_t i = rem / grid.stride[d];
        rem %= grid.stride[d];
        n *= grid.cuts[d][i + 1] - grid.cuts[d][i];
      }
      owned += n;
    }
    const int64_t bytes = t.bytes();
    s->gather_bytes += bytes - owned * dtype_bytes(t.dtype);
    s->network_bytes += bytes * static_cast<int64_t>(needers.size());
    (*src_nic)[g] += bytes * static_cast<int64_t>(needers.size());
    for (int32_t x : needers) (*rcv_nic)[x] += bytes;
  }
}

}  // namespace

// Computes minimum_network_bytes(L) on a thread of its own while the caller
// plans (it reads the layout alone: a sixth of planning DeepSeek-V3 at 2048
// ranks a side), or in get() where no thread starts. Joined on every path.
class MinimumBeside {
 public:
  explicit MinimumBeside(const Layout& L) : L_(L) {
    try {
      thread_ = std::thread([this] {
        try {
          bytes_ = minimum_network_bytes(L_);
        } catch (...) {
          error_ = std::current_exception();
        }
      });
    } catch (const std::system_error&) {
      // No thread: get() computes it.
    }
  }
  MinimumBeside(const MinimumBeside&) = delete;
  MinimumBeside& operator=(const MinimumBeside&) = delete;
  ~MinimumBeside() {
    if (thread_.joinable()) thread_.join();
  }
  int64_t get() {
    if (!thread_.joinable()) return minimum_network_bytes(L_);
    thread_.join();
    if (error_) std::rethrow_exception(error_);
    return bytes_;
  }

 private:
  const Layout& L_;
  int64_t bytes_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
};

// The threads that plan the units: options.threads, or one per core the
// process may use (`cores`, usable_cores()), at most one per
// kTensorsPerThread tensors (a small plan is not worth one).
constexpr uint32_t kTensorsPerThread = 1024;
int plan_threads(const PlanOptions& options, size_t tensors, int cores) {
  int n = options.threads > 0 ? options.threads : cores;
  if (options.threads == 0) n = std::min<int64_t>(n, static_cast<int64_t>(tensors / kTensorsPerThread));
  return std::clamp<int64_t>(n, 1, std::max<int64_t>(1, static_cast<int64_t>(tensors)));
}

// Plans every tensor's units into `planner`'s plan. On `threads`
// (plan_threads), each plans a range of consecutive tensors with a planner
// of its own (ranges of about equal work: a tensor's receiver regions), and
// `planner` adopts theirs in order: the same plan, the same first error
// (the lowest range's first).
Status plan_units(const Layout& L, const PlanOptions& options, int threads, Planner& planner) {
  const auto n = static_cast<uint32_t>(L.tensors.size());
  std::atomic<int64_t> done{0};
  auto plan_range = [&](Planner& p, uint32_t lo, uint32_t hi) -> Status {
    for (uint32_t ti = lo; ti < hi; ++ti) {
      if (options.progress && (ti - lo) % 64 == 0) {
        options.progress->set(PlanProgress::kTensors, done.fetch_add(std::min<uint32_t>(64, hi - ti)), n);
      }
      REFIT_RETURN_IF_ERROR(p.plan_tensor(ti));
    }
    return Status::ok();
  };
  if (threads <= 1) return plan_range(planner, 0, n);
  std::vector<uint32_t> bounds(static_cast<size_t>(threads) + 1, n);
  {
    int64_t total = 0;
    for (const Tensor& t : L.tensors) total += 1 + static_cast<int64_t>(t.receivers.size());
    bounds[0] = 0;
    int64_t sum = 0;
    int k = 1;
    for (uint32_t ti = 0; ti < n && k < threads; ++ti) {
      sum += 1 + static_cast<int64_t>(L.tensors[ti].receivers.size());
      while (k < threads && sum * threads >= total * k) bounds[k++] = ti + 1;
    }
  }
  struct Part {
    std::vector<Unit> units;
    std::vector<Consumer> consumers;
    std::vector<PullSet> pull_sets;
    std::optional<Planner> planner;
    Status status;
    std::exception_ptr error;
    std::thread thread;
  };
  std::vector<Part> parts(static_cast<size_t>(threads) - 1);
  auto run_part = [&](size_t k) {
    Part& part = parts[k];
    try {
      part.planner.emplace(L, options, &part.units, &part.consumers, &part.pull_sets);
      part.status = plan_range(*part.planner, bounds[k + 1], bounds[k + 2]);
    } catch (...) {
      part.error = std::current_exception();
    }
  };
  for (size_t k = 0; k < parts.size(); ++k) {
    try {
      parts[k].thread = std::thread(run_part, k);
    } catch (const std::system_error&) {
      // No thread: planned below, on this one.
    }
  }
  Status first;
  std::exception_ptr error;
  try {
    first = plan_range(planner, bounds[0], bounds[1]);
  } catch (...) {
    error = std::current_exception();
  }
  for (size_t k = 0; k < parts.size(); ++k) {
    if (parts[k].thread.joinable()) parts[k].thread.join();
    else if (!error && first.is_ok()) run_part(k);
  }
  if (error) std::rethrow_exception(error);
  REFIT_RETURN_IF_ERROR(first);
  for (Part& part : parts) {
    if (part.error) std::rethrow_exception(part.error);
    REFIT_RETURN_IF_ERROR(part.status);
  }
  for (Part& part : parts) {
    planner.adopt(*part.planner);
    part.planner.reset();
  }
  return Status::ok();
}

Result<Plan> make_plan(const Layout& L, const PlanOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options.chunk_bytes <= 0) return Status::invalid("chunk_bytes must be positive");
  if (options.relayout_below_bytes < 0) return Status::invalid("relayout_below_bytes must not be negative");
  if (options.relayout_staging_bytes < 0) return Status::invalid("relayout_staging_bytes must not be negative");
  if (options.threads < 0) return Status::invalid("threads must not be negative (0: one per usable core)");
  // The minimum network bytes, on a thread of its own: from the start where
  // a core is left beside the units' threads, else beside the placement,
  // which is on one thread.
  std::optional<MinimumBeside> minimum;
  const int cores = usable_cores();
  const int unit_threads = plan_threads(options, L.tensors.size(), cores);
  if (unit_threads <= 1 || unit_threads < cores) minimum.emplace(L);
  Plan plan;
  plan.layout_ = &L;
  plan.options_ = options;
  plan.options_.progress = nullptr;  // the caller's, for this call only
  plan.source_nic_.assign(L.sources.size(), 0);
  plan.receiver_nic_.assign(L.receivers.size(), 0);
  PlanSummary& s = plan.summary_;
  s.tensors = static_cast<int64_t>(L.tensors.size());
  for (const Tensor& t : L.tensors)
    if (t.derived_from < 0) s.total_bytes += t.bytes();

  if (options.strategy == Strategy::kBroadcast) {
    // A missing source still fails the same way as under refit.
    PlanOptions o = options;
    o.strategy = Strategy::kRefit;
    {
      std::vector<Unit> u;
      std::vector<Consumer> c;
      std::vector<PullSet> p;
      Planner probe(L, o, &u, &c, &p);
      for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) REFIT_RETURN_IF_ERROR(probe.plan_tensor(ti));
    }
    summarize_broadcast(L, &s, &plan.source_nic_, &plan.receiver_nic_);
  } else {
    {
      Planner planner(L, options, &plan.units_, &plan.consumers_, &plan.pull_sets_);
      REFIT_RETURN_IF_ERROR(plan_units(L, options, unit_threads, planner));
    }
    if (!minimum) minimum.emplace(L);

    // Bytes that have no choice go on the NICs first.
    std::vector<uint32_t> choose;  // units with a choice of puller or of sources
    for (uint32_t ui = 0; ui < plan.units_.size(); ++ui) {
      const Unit& u = plan.units_[ui];
      const int64_t bytes = plan.bytes(u);
      auto cs = plan.consumers(u);
      const bool one_rank = cs.front().rank == cs.back().rank;
      if (one_rank) plan.receiver_nic_[cs.front().rank] += bytes;
      const PullSet& ps = plan.pull_sets_[u.pull_set];
      if (!one_rank || !ps.forced) choose.push_back(ui);
      s.network_bytes += bytes;
      s.local_bytes += bytes * (static_cast<int64_t>(u.consumers_count) - 1);
      s.pulls += static_cast<int64_t>(ps.pieces.size());
    }
    const int64_t chunk_cap = options.chunk_bytes;
    // Forced source loads: accumulate per unit (the holder is fixed).
    // Chunk counts per (pull set, element size): tensors of different dtypes
    // can share a pull set, and chunks are cut in bytes.
    std::unordered_map<uint64_t, int64_t> chunks_of;
    for (const Unit& u : plan.units_) {
      const PullSet& ps = plan.pull_sets_[u.pull_set];
      const Tensor& t = L.tensors[u.tensor];
      const int eb = dtype_bytes(t.dtype);
      auto [it, inserted] = chunks_of.emplace((uint64_t{u.pull_set} << 8) | static_cast<uint64_t>(eb), 0);
      if (inserted) {
        for (const Piece& p : ps.pieces) it->second += count_chunks(p.box, std::max<int64_t>(1, chunk_cap / eb));
      }
      s.chunks += it->second;
      if (!ps.forced) continue;
      for (const Piece& p : ps.pieces) {
        const int32_t r = L.source_sets.get(t.sources[ps.holders[p.holders_begin]].ranks).front();
        plan.source_nic_[r] += p.box.numel() * eb;
      }
    }
    // Greedy: largest unit first, least loaded NIC, ties to the lowest rank.
    std::vector<std::pair<int64_t, uint32_t>> order;  // (-bytes, unit): largest first, then unit order
    order.reserve(choose.size());
    for (uint32_t ui : choose) {
      const Unit& u = plan.units_[ui];
      order.push_back({-plan.bytes(u), ui});
    }
    std::sort(order.begin(), order.end());
    int64_t placed = 0;
    for (auto [neg_bytes, ui] : order) {
      if (options.progress && (placed++ & 1023) == 0) {
        options.progress->set(PlanProgress::kPlacing, placed - 1, static_cast<int64_t>(order.size()));
      }
      Unit& u = plan.units_[ui];
      const Tensor& t = L.tensors[u.tensor];
      const int eb = dtype_bytes(t.dtype);
      const int64_t bytes = plan.bytes(u);
      auto cs = plan.consumers(u);
      if (cs.front().rank != cs.back().rank) {
        uint32_t best = 0;
        for (uint32_t k = 1; k < cs.size(); ++k)
          if (plan.receiver_nic_[cs[k].rank] < plan.receiver_nic_[cs[best].rank]) best = k;
        u.puller = best;
        plan.receiver_nic_[cs[best].rank] += bytes;
      }
      const PullSet& ps = plan.pull_sets_[u.pull_set];
      if (ps.forced) continue;
      u.sources_begin = static_cast<uint32_t>(plan.chosen_.size());
      const Region& dst = t.receivers[cs[u.puller].region];
      for (const Piece& p : ps.pieces) {
        // A holder from which the piece is one contiguous run beats one
        // that forces a strided pull (a GET per row), whatever the NIC
        // loads: a strided pull costs per GET, not per byte.
        bool any_contiguous = false;
        for (uint32_t k = 0; k < p.holders_count && !any_contiguous; ++k) {
          any_contiguous = contiguous_copy(p.box, t.sources[ps.holders[p.holders_begin + k]], dst);
        }
        SourcePick best{-1, 0};
        for (uint32_t k = 0; k < p.holders_count; ++k) {
          const uint32_t region = ps.holders[p.holders_begin + k];
          if (any_contiguous && !contiguous_copy(p.box, t.sources[region], dst)) continue;
          for (int32_t r : L.source_sets.get(t.sources[region].ranks)) {
            if (best.rank == -1 || plan.source_nic_[r] < plan.source_nic_[best.rank] ||
                (plan.source_nic_[r] == plan.source_nic_[best.rank] && r < best.rank))
              best = {r, region};
          }
        }
        plan.source_nic_[best.rank] += p.box.numel() * eb;
        plan.chosen_.push_back(best);
      }
    }
    s.units = static_cast<int64_t>(plan.units_.size());
  }
  if (!minimum) minimum.emplace(L);
  s.minimum_network_bytes = minimum->get();
  for (int64_t b : plan.source_nic_) s.max_source_nic_bytes = std::max(s.max_source_nic_bytes, b);
  for (int64_t b : plan.receiver_nic_) s.max_receiver_nic_bytes = std::max(s.max_receiver_nic_bytes, b);
  s.threads = options.strategy == Strategy::kBroadcast ? 1 : unit_threads;
  s.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace refit
