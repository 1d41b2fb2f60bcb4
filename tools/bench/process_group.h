#pragma once
// One child process per rank, each talking to the parent over its own
// socketpair (a two-way pipe) in length-prefixed JSON messages.
//
// Nothing is ever left running or hung:
// - every wait has a deadline; a child that misses it, dies, or answers with
//   garbage is an error that names the child and what it was asked;
// - on any such error the group SIGKILLs and reaps every child, and the
//   destructor does the same with whatever is still running;
// - each child asks the kernel for SIGKILL when the parent dies
//   (PR_SET_PDEATHSIG), so a parent killed by a timeout takes its children
//   with it.
//
// Children are made with fork() and run a function of the parent's image;
// fork from a process that has no threads yet (before starting a
// coordinator or anything with an I/O thread), so that no lock is inherited
// held. A child leaves with _exit(), running no atexit handler of the parent.
//
// Thread safety: one thread owns a ProcessGroup.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/status.h"

namespace refit::bench {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// One end of a child's socketpair.
class Channel {
 public:
  explicit Channel(int fd) : fd_(fd) {}
  int fd() const { return fd_; }
  Status send(const Json& message);
  // The next message; an error when the peer closed, sent garbage, or
  // nothing complete arrived before `deadline`.
  Result<Json> receive(Clock::time_point deadline);

 private:
  int fd_ = -1;
};

class ProcessGroup {
 public:
  ProcessGroup() = default;
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Forks a child named `name` ("source 1") that runs body(channel) and
  // leaves with its return value. Returns the child's index in the group.
  // With `netns`, the child first moves into that network namespace (a
  // name under /run/netns) with a /sys of its own (hosts.h's enter_host)
  // and exits with status 126 when it cannot.
  Result<size_t> spawn(std::string name, std::function<int(Channel&)> body, const std::string& netns = "");

  size_t size() const { return children_.size(); }
  const std::string& name(size_t child) const { return children_[child].name; }
  pid_t pid(size_t child) const { return children_[child].pid; }
  // False once the child has been reaped (killed by the group, or gone).
  bool running(size_t child) const { return !children_[child].reaped && children_[child].fd >= 0; }

  // Sends `command` to each of `children`, then waits until every one has
  // answered, at most until `deadline`. A reply {"ok": false, "error": m} is
  // an error naming the child and m. Replies come back in `children` order.
  // On any failure every child is killed.
  Result<std::vector<Json>> request(const std::vector<size_t>& children, const Json& command,
                                    Clock::time_point deadline);
  Result<Json> request(size_t child, const Json& command, Clock::time_point deadline);
  // The same, with commands[k] for children[k].
  Result<std::vector<Json>> request_each(const std::vector<size_t>& children, const std::vector<Json>& commands,
                                         Clock::time_point deadline);

  // One child's answer to a command sent with request_tolerating: its reply
  // when "ok", else what went wrong (its error, its death, no answer).
  struct Answer {
    bool ok = false;
    Json reply;
    std::string error;
    // No answer came before the deadline: the child may still be running
    // the command, and its late answer would be read as the next one's.
    bool late = false;
  };
  // Like request(), but a child's failure is its Answer, and nothing is
  // killed for it; with a victim, the victim (which may or may not be one of
  // `children`) is SIGKILLed and reaped at `kill_at`. Returns once every
  // child answered or `deadline` passed, and the victim is dead; with
  // `killed_ns`, when the victim was sent SIGKILL (monotonic_ns()).
  std::vector<Answer> request_tolerating(const std::vector<size_t>& children, const Json& command,
                                         Clock::time_point deadline, size_t victim = SIZE_MAX,
                                         Clock::time_point kill_at = Clock::time_point::max(),
                                         int64_t* killed_ns = nullptr);

  // Asks every child still running to exit and waits for it until
  // `deadline`, then kills what is left. Returns the first problem: a child
  // that had to be killed or exited with a non-zero status (a victim of
  // request_tolerating is no problem: it was meant to die).
  Status shut_down(Clock::time_point deadline);

  // SIGKILLs and reaps every child still running. Idempotent.
  void kill_all();

 private:
  struct Child {
    std::string name;
    pid_t pid = -1;
    int fd = -1;
    bool reaped = false;
    int wait_status = 0;
    bool victim = false;  // killed on purpose by request_tolerating: shut_down does not count it
  };
  // Why `c` stopped answering: its exit status if it is gone.
  std::string describe_death(Child& c);
  Status fail(Status status);

  std::vector<Child> children_;
};

// Nanoseconds since an arbitrary epoch that every process of the machine
// shares (CLOCK_MONOTONIC): children stamp when they finished, the parent
// compares with when it asked.
int64_t monotonic_ns();

}  // namespace refit::bench
