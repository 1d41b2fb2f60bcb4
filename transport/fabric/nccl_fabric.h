#pragma once
// The local fabric over NCCL (device buffers of the ranks of one NVLink
// domain). The data movement is a DomainComm (transport/cuda/device_ops.h):
// NCCL in production (transport/cuda/nccl_comm.h), an in-process host
// implementation in the CPU tests, which run this whole class.
//
// One communicator per domain. Every rank's contact carries a fresh NCCL
// unique id; the communicator of a domain is built from the id of the first
// (lowest) rank of Schedule::domain, NCCL rank = index in that list. It is
// kept across refreshes while the list of (rank, instance, comm epoch) read
// from the contacts is unchanged, and rebuilt when it changes. Building is
// collective: every member of the domain must begin a refresh of the same
// membership, also one that passes nothing on.
//
// An NCCL unique id serves one communicator (its bootstrap root answers
// once), so a rank's contact changes (contact_changed()) when its id was
// used as the root's, and when it had to abort a communicator; in that case
// its comm epoch goes up too, which makes every member rebuild. The agent
// re-registers the contact before the next refresh.
//
// Why rounds, not receives posted up front: operations of one NCCL
// communicator run one after another, in issue order. Ranks that both send
// to and receive from each other (the usual case: every rank pulls some
// units for the others) would each wait in their up-front receives for
// sends queued behind them: a deadlock. Instead the round thread runs
// rounds, each two groups on the communicator's stream:
//   counts  to every peer it still sends to: the sends it passes on in this
//           round, in the order they became ready (send()), at most
//           max_sends_per_round and kMaxRanges runs of consecutive
//           positions, named by their positions in the pair's plan-order
//           list, with their count, bytes and a 64-bit digest of their
//           sizes in that order (round_words.h), or kFailedMarker; from
//           every peer it still receives from: theirs;
//   data    those sends, and the receives the counts name, in the order
//           announced (Schedule::recvs is per peer in the order of the
//           peer's sends, so position k of one list is position k of the
//           other).
// Ready order, not plan order: a slice whose GET is still on its way does
// not hold back the slices that landed after it (docs/refresh.md, "The
// local fabrics").
// A pair (a to b) takes part in rounds 1, 2, ... until its last item at
// both ends, so the k-th round of a pair is the k-th round of both of its
// ranks: every group of round k matches only groups of round k, and the
// rounds run like a sequence of collectives. A rank's copies to itself
// (kSelf) ride in the data group as a send and a receive to its own rank.
//
// Failure and deadline: finish(true) sends kFailedMarker to every peer it
// still owes bytes, then goes on receiving until its peers are done, so
// nobody waits for it until the deadline. A peer's marker fails this rank's
// refresh with an io_error naming it. At the deadline (a peer gone, or hung)
// the communicator is aborted (ncclCommAbort) and the refresh fails with a
// timeout naming the ranks still owed; every rank does the same at its own
// deadline, so no rank hangs. cancel() (LocalFabric) ends the waits the
// same way, at once, except the building of the communicator, which only
// its deadline ends. The count, bytes and sizes' digest each round
// announces are checked against the receives' (each end hashes its own
// sizes): a mismatch fails the refresh naming the peer, not a corrupt write.
//
// Threads: begin, send, finish and end from the agent's fan-out thread, as
// LocalFabric says. begin() fills the per-refresh members and starts the
// round thread, which owns them, comm_ and comm_key_ until finish()/end()
// join it. mu_ guards ready_, ready_generation_, passed_all_, failing_,
// id_, comm_epoch_ and contact_changed_; cv_ wakes the round thread when
// sends become ready or the refresh finishes.
//
// Packed fan-out (pack.h; docs/refresh.md, "Packed fan-out"): with
// pack_bytes > 0 and a factory that can_scatter(), the round's sends to a
// peer are laid out by plan_pack(): the small ones are gathered (one
// scatter-kernel launch for all peers, on the stream after the upstream
// copies) into this rank's send pack area and cross as one send per peer,
// ahead of the large ones; the peer lays out the same from the receives the
// counts announce, receives the pack into its receive pack area, and
// scatters it into the receives' places on the stream, so the last round's
// wait covers it. A peer's pack is at most pack_bytes / (domain size - 1),
// so the packs of one round fit the areas; the round that would pass it
// stops there (its count says so). The areas are the communicator's (two
// of pack_bytes in device memory), kept with it. Every member must pack
// alike: the contact carries pack_bytes (0 where packing is off or the
// factory cannot scatter) and pack_threshold, and begin() refuses a domain
// whose pack_bytes differ, or whose thresholds differ while it packs.
//
// Cost: a round is two groups, one of them kRoundWordsPerPeer words (512
// bytes) per pair and way;
// the round thread polls (yields) while a round is in flight.

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <span>
#include <thread>
#include <tuple>

#include "transport/common/threads.h"
#include "transport/cuda/device_ops.h"
#include "transport/fabric/local_fabric.h"
#include "transport/fabric/pack.h"
#include "transport/fabric/round_words.h"

namespace refit::fabric {

struct NcclFabricConfig {
  int32_t rank = 0;
  uint32_t max_sends_per_round = kDefaultMaxSendsPerRound;  // per peer and round
  // The packed fan-out (pack.h): pack_bytes per area (0: off), sends of at
  // least pack_threshold bytes unpacked. Every rank of a domain the same.
  PackLimits pack;
  std::chrono::microseconds idle_wait{50};  // between rounds that moved nothing
  // Starts each refresh's round thread (tests hand one that refuses;
  // transport/common/threads.h).
  ThreadFactory threads;
};

class NcclFabric final : public LocalFabric {
 public:
  static constexpr uint64_t kFailedMarker = UINT64_MAX;

  static Result<std::unique_ptr<NcclFabric>> create(const NcclFabricConfig& config,
                                                    std::unique_ptr<cuda::CommFactory> factory);
  ~NcclFabric() override;

  const char* name() const override { return "nccl"; }
  // NCCL needs no registration: returns an empty key.
  Result<std::vector<uint8_t>> register_buffer(const std::string& name, void* data, uint64_t bytes) override;
  std::vector<uint8_t> contact() const override;
  Status begin(const Schedule& schedule, Clock::time_point deadline) override;
  // Marks the sends ready; the round thread passes them on. The caller must
  // not write their source bytes until finish() returned.
  Status send(std::span<const uint32_t> ready) override;
  Status finish(bool failed) override;
  void end() override;

  // Whether contact() changed since it was last called: the agent
  // re-registers it with the coordinator before the next refresh.
  bool contact_changed() const override;
  // How many communicators this fabric has built (tests).
  uint64_t communicators_built() const { return built_; }
  // Whether this fabric packs (pack_bytes > 0 and the factory can scatter).
  bool packing() const { return pack_.pack_bytes > 0; }
  // Packs sent and the sends that went in them, since the fabric was made.
  uint64_t packs_sent() const { return packs_sent_; }
  uint64_t packed_sends() const { return packed_sends_; }
  // Rounds to a peer that stopped early because its pack was full.
  uint64_t packs_full() const { return packs_full_; }
  // Receives its peers announced in rounds (their groups issued), since the
  // fabric was made.
  uint64_t slices_received() const { return slices_received_; }

  struct ContactInfo {
    uint64_t instance = 0;    // random per fabric
    uint64_t comm_epoch = 0;  // goes up when the fabric aborted a communicator
    std::vector<uint8_t> id;  // the NCCL unique id
    uint64_t pack_bytes = 0;  // its packing (0: off)
    uint64_t pack_threshold = 0;
  };
  // Reads receiver rank `rank`'s contact (peer input, untrusted): reads
  // only inside `bytes`, and refuses (invalid_argument naming the rank) a
  // contact of another fabric or format, a truncated one, and one whose
  // unique id is empty or not as long as it says.
  static Result<ContactInfo> parse_contact(std::span<const uint8_t> bytes, int32_t rank);

 private:
  using Key = std::vector<std::tuple<int32_t, uint64_t, uint64_t>>;
  NcclFabric(NcclFabricConfig config, std::unique_ptr<cuda::CommFactory> factory)
      : config_(config), factory_(std::move(factory)) {}
  void rounds();
  Status check_packing(const ContactInfo& c, int32_t rank) const;
  Status start_rounds();
  Status exchange_counts(const std::vector<int32_t>& act_out, const std::vector<int32_t>& act_in,
                         std::vector<cuda::P2p>& group);
  Status prepare_packs();
  void pack_round(int32_t p);
  void add_sends(int32_t p, std::vector<cuda::P2p>& group);
  Status add_recvs(int32_t p, const uint64_t* words, std::vector<cuda::P2p>& group);
  Status ensure_comm();
  Status wait_idle(const char* what);
  void drop_comm();
  std::string owed_ranks() const;

  const NcclFabricConfig config_;
  std::unique_ptr<cuda::CommFactory> factory_;
  uint64_t instance_ = 0;
  std::atomic<uint64_t> built_{0};
  PackLimits pack_;  // what this rank packs with: config_.pack, off where the factory cannot scatter
  std::atomic<uint64_t> packs_sent_{0}, packed_sends_{0}, packs_full_{0}, slices_received_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> id_;             // mu_
  uint64_t comm_epoch_ = 0;             // mu_
  mutable bool contact_changed_ = false;  // mu_
  std::vector<uint8_t> ready_;          // mu_: per send
  // mu_: per NCCL rank, positions in out_[rank] in the order send() passed
  // them; the copies to itself likewise, positions in self_.
  std::vector<std::vector<uint32_t>> ready_pos_;
  std::vector<uint32_t> self_ready_pos_;
  uint64_t ready_generation_ = 0;       // mu_: goes up with every send()
  bool passed_all_ = false;             // mu_
  bool failing_ = false;                // mu_

  // Kept across refreshes; the round thread's while it runs.
  std::unique_ptr<cuda::DomainComm> comm_;
  Key comm_key_;

  // One refresh (begin .. end): set by begin(), then the round thread's.
  const Schedule* schedule_ = nullptr;
  Clock::time_point deadline_;
  Key key_;
  std::vector<uint8_t> root_id_;
  int32_t me_ = 0;                                 // NCCL rank
  std::vector<int32_t> ranks_;                     // NCCL rank -> receiver rank
  std::vector<std::vector<uint32_t>> out_;         // per NCCL rank: sends, plan order
  std::vector<std::vector<uint32_t>> in_;          // per NCCL rank: receives, peer's order
  std::vector<uint32_t> self_;                     // kSelf sends, plan order
  std::vector<int32_t> send_peer_;                 // per send: its NCCL rank, -1 to itself
  std::vector<uint32_t> send_pos_;                 // per send: its position in out_ or self_
  std::vector<size_t> out_next_;                   // per NCCL rank: sends passed on (into ready_pos_)
  std::vector<size_t> in_count_;                   // per NCCL rank: receives announced
  std::vector<std::vector<uint8_t>> in_got_;       // per NCCL rank and receive: announced
  size_t self_next_ = 0;                           // into self_ready_pos_
  std::vector<std::vector<uint32_t>> take_;        // per NCCL rank: this round's positions
  std::vector<uint32_t> self_take_, recv_pos_;     // scratch of one round
  std::vector<uint8_t> out_closed_, in_failed_;
  // Packing, per refresh and round (the round thread's).
  uint64_t share_ = 0;                             // a peer's pack bytes per round; 0: off
  cuda::DomainComm::PackAreas areas_;
  uint64_t send_used_ = 0, recv_used_ = 0;         // of the areas, this round
  std::vector<PackLayout> out_pack_;               // per NCCL rank: this round's sends
  std::vector<cuda::ScatterPiece> gather_, scatter_;  // this round's
  std::vector<uint64_t> sizes_;                    // scratch
  std::thread thread_;
  Status result_;                                  // the round thread's, read after join
};

}  // namespace refit::fabric
