#include "host_comm.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <random>
#include <thread>

namespace refit::cuda::testing {
namespace {

struct Op {
  P2p p2p;
  bool done = false;
};

struct Item {
  enum class Kind { kPut, kGet, kGroup, kScatter } kind = Kind::kGroup;
  size_t from = 0, n = 0;
  std::vector<std::shared_ptr<Op>> ops;
  bool posted = false;
  std::vector<ScatterPiece> pieces;  // kScatter
};

class HostComm;

// The ranks of one communicator.
struct World {
  std::mutex mu;
  std::condition_variable joined_cv;
  int32_t size = 0;
  std::vector<HostComm*> ranks;
  int32_t joined = 0;
  // (from, to) -> posted sends / receives, in order.
  std::map<std::pair<int32_t, int32_t>, std::deque<std::shared_ptr<Op>>> sends, recvs;
  void progress();  // mu held
};

class HostComm final : public DomainComm {
 public:
  HostComm(std::shared_ptr<World> world, int32_t rank)
      : world_(std::move(world)), rank_(rank), words_(2 * kCountWordsPerPeer * world_->size),
        host_(2 * kCountWordsPerPeer * world_->size) {}
  ~HostComm() override { abort(); }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return world_->size; }
  void set_deadline(Clock::time_point) override {}
  uint64_t* words() override { return words_.data(); }
  uint64_t* host_words() override { return host_.data(); }
  size_t word_count() const override { return words_.size(); }
  Status put_words(size_t n) override { return push(Item{Item::Kind::kPut, 0, n, {}, false}); }
  Status get_words(size_t from, size_t n) override { return push(Item{Item::Kind::kGet, from, n, {}, false}); }
  Status order_after_upstream() override { return Status::ok(); }
  Status issue(std::span<const P2p> group) override {
    Item item;
    for (const P2p& p : group) {
      if (p.peer < 0 || p.peer >= world_->size) return Status::invalid("host comm: no rank " + std::to_string(p.peer));
      item.ops.push_back(std::make_shared<Op>(Op{p, false}));
    }
    return push(std::move(item));
  }
  Result<PackAreas> pack_areas(uint64_t bytes, size_t max_pieces) override {
    std::lock_guard<std::mutex> lock(world_->mu);
    if (!stream_.empty()) return Status::internal("host comm: pack_areas() while work is in flight");
    if (send_area_.size() != bytes) {
      send_area_.assign(bytes, 0);
      recv_area_.assign(bytes, 0);
    }
    max_pieces_ = max_pieces;
    return PackAreas{send_area_.data(), recv_area_.data()};
  }
  // Checked as the kernel's contract asks, so that a fabric bug is an error
  // here rather than a stray write: each piece gathers into the send area
  // or scatters out of the receive area, wholly inside it, its other end
  // outside both areas, and no two pieces write the same bytes.
  Status scatter(std::span<const ScatterPiece> pieces) override {
    if (pieces.size() > max_pieces_) {
      return Status::invalid("host comm: a scatter of " + std::to_string(pieces.size()) +
                             " pieces, pack_areas() sized " + std::to_string(max_pieces_));
    }
    auto in = [](const std::vector<uint8_t>& area, const uint8_t* p, uint64_t n) {
      const auto a = reinterpret_cast<uintptr_t>(area.data()), x = reinterpret_cast<uintptr_t>(p);
      return x >= a && n <= area.size() && x - a <= area.size() - n;
    };
    auto touches = [](const std::vector<uint8_t>& area, const uint8_t* p, uint64_t n) {
      const auto a = reinterpret_cast<uintptr_t>(area.data()), x = reinterpret_cast<uintptr_t>(p);
      return x < a + area.size() && a < x + n;
    };
    std::vector<std::pair<uintptr_t, uint64_t>> writes;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const ScatterPiece& pc = pieces[i];
      const bool into_send = in(send_area_, pc.dst, pc.bytes) && !touches(send_area_, pc.src, pc.bytes) &&
                          !touches(recv_area_, pc.src, pc.bytes);
      const bool out_of_recv = in(recv_area_, pc.src, pc.bytes) && !touches(send_area_, pc.dst, pc.bytes) &&
                           !touches(recv_area_, pc.dst, pc.bytes);
      if (pc.bytes == 0 || pc.dst == nullptr || pc.src == nullptr ||
          reinterpret_cast<uintptr_t>(pc.dst) > UINTPTR_MAX - pc.bytes ||
          reinterpret_cast<uintptr_t>(pc.src) > UINTPTR_MAX - pc.bytes || !(into_send || out_of_recv)) {
        return Status::invalid("host comm: scatter piece " + std::to_string(i) + " of " + std::to_string(pc.bytes) +
                               " bytes is not a gather into the send area nor a scatter out of the receive area");
      }
      writes.emplace_back(reinterpret_cast<uintptr_t>(pc.dst), pc.bytes);
    }
    std::sort(writes.begin(), writes.end());
    for (size_t i = 1; i < writes.size(); ++i) {
      if (writes[i - 1].first + writes[i - 1].second > writes[i].first) {
        return Status::invalid("host comm: two scatter pieces write the same bytes");
      }
    }
    Item item;
    item.kind = Item::Kind::kScatter;
    item.pieces.assign(pieces.begin(), pieces.end());
    return push(std::move(item));
  }
  Result<bool> idle() override {
    std::lock_guard<std::mutex> lock(world_->mu);
    if (aborted_) return Status::internal("host comm: used after abort");
    world_->progress();
    if (!error_.is_ok()) return error_;
    return stream_.empty();
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(world_->mu);
    if (aborted_) return;
    aborted_ = true;
    // Withdraw what this rank posted; the peers' matching operations stay
    // unmatched, as they would behind an aborted NCCL rank.
    for (Item& item : stream_) {
      for (auto& q : {&world_->sends, &world_->recvs}) {
        for (auto& [pair, ops] : *q) {
          for (auto it = ops.begin(); it != ops.end();) {
            bool mine = false;
            for (auto& op : item.ops) mine |= (*it == op);
            it = mine ? ops.erase(it) : it + 1;
          }
        }
      }
    }
    stream_.clear();
    world_->ranks[rank_] = nullptr;
  }

  // World::progress, mu held: runs the head of the stream while it can.
  bool step() {
    bool any = false;
    while (!aborted_ && error_.is_ok() && !stream_.empty()) {
      Item& item = stream_.front();
      if (item.kind == Item::Kind::kPut) {
        std::memcpy(words_.data(), host_.data(), item.n * 8);
      } else if (item.kind == Item::Kind::kGet) {
        std::memcpy(host_.data() + item.from, words_.data() + item.from, item.n * 8);
      } else if (item.kind == Item::Kind::kScatter) {
        for (const ScatterPiece& pc : item.pieces) std::memcpy(pc.dst, pc.src, pc.bytes);
      } else {
        if (!item.posted) {
          for (auto& op : item.ops) {
            const P2p& p = op->p2p;
            if (p.kind == P2p::Kind::kSend) {
              world_->sends[{rank_, p.peer}].push_back(op);
            } else {
              world_->recvs[{p.peer, rank_}].push_back(op);
            }
          }
          item.posted = true;
          any = true;
        }
        bool all = true;
        for (auto& op : item.ops) all &= op->done;
        if (!all) break;
      }
      stream_.pop_front();
      any = true;
    }
    return any;
  }
  void fail(const Status& s) {
    if (error_.is_ok()) error_ = s;
  }

 private:
  Status push(Item item) {
    std::lock_guard<std::mutex> lock(world_->mu);
    if (aborted_) return Status::internal("host comm: used after abort");
    stream_.push_back(std::move(item));
    world_->progress();
    return error_;
  }

  std::shared_ptr<World> world_;
  int32_t rank_;
  std::vector<uint64_t> words_;
  std::vector<uint64_t> host_;
  std::deque<Item> stream_;
  std::vector<uint8_t> send_area_, recv_area_;
  size_t max_pieces_ = 0;
  bool aborted_ = false;
  Status error_;
};

void World::progress() {
  bool any = true;
  while (any) {
    any = false;
    for (HostComm* c : ranks) {
      if (c) any |= c->step();
    }
    for (auto& [pair, ops] : sends) {
      auto& r = recvs[pair];
      while (!ops.empty() && !r.empty()) {
        Op& s = *ops.front();
        Op& d = *r.front();
        if (s.p2p.bytes != d.p2p.bytes) {
          const Status err = Status::invalid("host comm: rank " + std::to_string(pair.first) + " sent " +
                                             std::to_string(s.p2p.bytes) + " bytes, rank " +
                                             std::to_string(pair.second) + " expected " + std::to_string(d.p2p.bytes));
          if (ranks[pair.first]) ranks[pair.first]->fail(err);
          if (ranks[pair.second]) ranks[pair.second]->fail(err);
          return;
        }
        std::memcpy(d.p2p.data, s.p2p.data, s.p2p.bytes);
        s.done = d.done = true;
        ops.pop_front();
        r.pop_front();
        any = true;
      }
    }
  }
}

std::mutex registry_mu;
std::condition_variable registry_cv;
std::map<std::vector<uint8_t>, std::shared_ptr<World>> registry;  // ids not yet spent

}  // namespace

Result<std::vector<uint8_t>> HostCommFactory::unique_id() {
  static std::mutex mu;
  static std::mt19937_64 rng(std::random_device{}());
  std::lock_guard<std::mutex> lock(mu);
  std::vector<uint8_t> id(32);
  for (uint8_t& b : id) b = static_cast<uint8_t>(rng());
  return id;
}

Result<std::unique_ptr<DomainComm>> HostCommFactory::connect(const std::vector<uint8_t>& id, int32_t size,
                                                             int32_t rank, Clock::time_point deadline) {
  if (rank < 0 || rank >= size) return Status::invalid("host comm: rank " + std::to_string(rank) + " of " + std::to_string(size));
  std::unique_lock<std::mutex> lock(registry_mu);
  std::shared_ptr<World>& w = registry[id];
  if (!w) {
    w = std::make_shared<World>();
    w->size = size;
    w->ranks.assign(size, nullptr);
  }
  std::shared_ptr<World> world = w;
  if (world->size != size) return Status::invalid("host comm: ranks disagree on the size");
  std::unique_ptr<HostComm> comm;
  {
    std::lock_guard<std::mutex> wl(world->mu);
    if (world->ranks[rank] != nullptr) return Status::invalid("host comm: rank " + std::to_string(rank) + " joined twice");
    comm = std::make_unique<HostComm>(world, rank);
    world->ranks[rank] = comm.get();
    ++world->joined;
  }
  registry_cv.notify_all();
  if (!registry_cv.wait_until(lock, deadline, [&] { return world->joined == size; })) {
    std::lock_guard<std::mutex> wl(world->mu);
    world->ranks[rank] = nullptr;
    --world->joined;
    return Status::timeout("host comm: " + std::to_string(size - world->joined - 1) +
                           " rank(s) did not join before the deadline");
  }
  // The id is spent, as NCCL's is once its root has answered every rank.
  auto it = registry.find(id);
  if (it != registry.end() && it->second == world) registry.erase(it);
  ++connects_;
  return std::unique_ptr<DomainComm>(std::move(comm));
}

}  // namespace refit::cuda::testing
