#pragma once
// CopyOps on the host: a thread of its own runs the copies in issue order,
// like a CUDA stream, optionally slowed down, so that the GPU path's logic
// (the landing ring and the receiver's lander) runs for real on a machine
// without a GPU: in the CPU tests, and in a receiver told to land its GETs
// for host buffers in the landing ring (the test-only config key
// "test": {"force_landing_ring": true}, docs/receiver.md).
// Its thread starts through a ThreadFactory (transport/common/threads.h): a
// refused one fails create(), and one whose copy throws fails every later
// call with the reason.

#include <condition_variable>
#include <deque>
#include <mutex>
#include <memory>
#include <thread>

#include "transport/common/threads.h"
#include "transport/cuda/copy_plan.h"
#include "transport/cuda/device_ops.h"

namespace refit::cuda {

class HostCopyOps final : public CopyOps {
 public:
  // `per_copy`: how long each copy takes at least.
  static Result<std::unique_ptr<HostCopyOps>> create(std::chrono::microseconds per_copy = std::chrono::microseconds(0),
                                                     const ThreadFactory& threads = {}) {
    std::unique_ptr<HostCopyOps> ops(new HostCopyOps(per_copy));
    HostCopyOps* p = ops.get();
    Result<std::thread> t = threads.start("host copy", [p] { p->loop(); }, [p](const Status& why) {
      std::lock_guard<std::mutex> lock(p->mu_);
      p->failed_ = why;
    });
    if (!t.is_ok()) return t.status();
    ops->thread_ = std::move(t).value();
    return ops;
  }
  ~HostCopyOps() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  Status copy(const Copy& c) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.is_ok()) return failed_;
    if (fail_next_) {
      fail_next_ = false;
      return Status::io_error("host copy: failing as the test asked");
    }
    queue_.push_back(Item{c, 0});
    cv_.notify_all();
    return Status::ok();
  }
  Result<uint64_t> record() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.is_ok()) return failed_;
    const uint64_t t = ++issued_;
    queue_.push_back(Item{Copy{}, t});
    cv_.notify_all();
    return t;
  }
  Result<bool> done(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.is_ok()) return failed_;
    return ticket <= completed_;
  }
  void fail_next_copy() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_ = true;
  }

 private:
  explicit HostCopyOps(std::chrono::microseconds per_copy) : per_copy_(per_copy) {}
  struct Item {
    Copy copy;
    uint64_t ticket = 0;  // a record() when non-zero
  };
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Item item = queue_.front();
      queue_.pop_front();
      if (item.ticket != 0) {
        completed_ = item.ticket;
        continue;
      }
      lock.unlock();
      if (per_copy_.count() > 0) std::this_thread::sleep_for(per_copy_);
      copy_on_host(item.copy);
      lock.lock();
    }
  }

  const std::chrono::microseconds per_copy_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  uint64_t issued_ = 0;
  uint64_t completed_ = 0;
  bool stop_ = false;
  bool fail_next_ = false;
  Status failed_;  // the thread failed: every call returns it
  std::thread thread_;
};

}  // namespace refit::cuda
