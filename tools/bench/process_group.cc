#include "tools/bench/process_group.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "tools/bench/hosts.h"

namespace refit::bench {

namespace {

constexpr uint32_t kMaxMessageBytes = 64u << 20;

// The parent's ends of every group's children (several groups may run at
// once, each from a thread of its own); a new child closes them all, so
// that EOF on its end means that the parent is gone. Forks happen while the
// process has no other threads, so the mutex is never inherited held.
std::mutex parent_ends_mu;
std::set<int>& parent_ends() {
  static std::set<int> fds;
  return fds;
}
void close_parent_end(int* fd) {
  if (*fd < 0) return;
  {
    std::lock_guard<std::mutex> lock(parent_ends_mu);
    parent_ends().erase(*fd);
  }
  ::close(*fd);
  *fd = -1;
}

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 1000000 ? 1000000 : static_cast<int>(left);
}

bool write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    b += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Reads exactly n bytes by `deadline`: "" on success, else why not.
std::string read_all(int fd, void* p, size_t n, Clock::time_point deadline) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    pollfd pf = {fd, POLLIN, 0};
    int left = ms_left(deadline);
    if (left == 0) return "timed out";
    int r = ::poll(&pf, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return std::string("poll failed: ") + std::strerror(errno);
    if (r == 0) continue;
    ssize_t k = ::read(fd, b, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return std::string("read failed: ") + std::strerror(errno);
    if (k == 0) return "closed";
    b += k;
    n -= static_cast<size_t>(k);
  }
  return "";
}

}  // namespace

int64_t monotonic_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

Status Channel::send(const Json& message) {
  const std::string text = message.dump();
  const uint32_t n = static_cast<uint32_t>(text.size());
  if (text.size() > kMaxMessageBytes) return Status::internal("message of " + std::to_string(text.size()) + " bytes is too big");
  if (!write_all(fd_, &n, sizeof n) || !write_all(fd_, text.data(), text.size()))
    return Status::io_error(std::string("send failed: ") + std::strerror(errno));
  return Status::ok();
}

Result<Json> Channel::receive(Clock::time_point deadline) {
  uint32_t n = 0;
  std::string why = read_all(fd_, &n, sizeof n, deadline);
  if (!why.empty()) return Status::io_error(why);
  if (n > kMaxMessageBytes) return Status::io_error("a message announced " + std::to_string(n) + " bytes");
  std::string text(n, '\0');
  why = read_all(fd_, text.data(), n, deadline);
  if (!why.empty()) return Status::io_error(why + " in the middle of a message");
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::io_error("a message is not JSON");
  return j;
}

ProcessGroup::~ProcessGroup() { kill_all(); }

Result<size_t> ProcessGroup::spawn(std::string name, std::function<int(Channel&)> body, const std::string& netns) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return Status::io_error("socketpair for " + name + ": " + std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(sv[0]);
    ::close(sv[1]);
    return Status::io_error("fork for " + name + ": " + std::strerror(errno));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(125);  // the parent died before prctl
    ::close(sv[0]);
    for (int fd : parent_ends()) ::close(fd);  // siblings' ends: EOF must mean the parent is gone
    if (!netns.empty()) {
      Status entered = enter_host(netns);
      if (!entered.is_ok()) {
        std::fprintf(stderr, "%s: %s\n", name.c_str(), entered.message().c_str());
        ::_exit(126);
      }
    }
    Channel channel(sv[1]);
    int rc = 1;
    try {
      rc = body(channel);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
    }
    std::fflush(stderr);
    ::_exit(rc);
  }
  ::close(sv[1]);
  {
    std::lock_guard<std::mutex> lock(parent_ends_mu);
    parent_ends().insert(sv[0]);
  }
  children_.push_back(Child{std::move(name), pid, sv[0]});
  return children_.size() - 1;
}

std::string ProcessGroup::describe_death(Child& c) {
  if (!c.reaped) {
    // Give a child that closed its end a moment to finish dying.
    for (int i = 0; i < 50 && !c.reaped; ++i) {
      if (::waitpid(c.pid, &c.wait_status, WNOHANG) == c.pid) c.reaped = true;
      else ::usleep(2000);
    }
  }
  if (!c.reaped) return "";
  if (WIFEXITED(c.wait_status)) return " (it exited with status " + std::to_string(WEXITSTATUS(c.wait_status)) + ")";
  if (WIFSIGNALED(c.wait_status))
    return " (it was killed by signal " + std::to_string(WTERMSIG(c.wait_status)) + ", " +
           strsignal(WTERMSIG(c.wait_status)) + ")";
  return "";
}

Status ProcessGroup::fail(Status status) {
  kill_all();
  return status;
}

Result<std::vector<Json>> ProcessGroup::request(const std::vector<size_t>& children, const Json& command,
                                                Clock::time_point deadline) {
  return request_each(children, std::vector<Json>(children.size(), command), deadline);
}

Result<std::vector<Json>> ProcessGroup::request_each(const std::vector<size_t>& children,
                                                     const std::vector<Json>& commands, Clock::time_point deadline) {
  if (commands.size() != children.size()) return fail(Status::internal("request_each: one command per child"));
  const std::string what = commands.empty() ? "?" : commands.front().value("cmd", std::string("?"));
  for (size_t k = 0; k < children.size(); ++k) {
    Child& c = children_[children[k]];
    if (c.reaped || c.fd < 0) return fail(Status::io_error(c.name + " is not running (asked to " + what + ")"));
    Channel ch(c.fd);
    Status s = ch.send(commands[k]);
    if (!s.is_ok())
      return fail(Status::io_error(c.name + ": cannot send \"" + what + "\": " + s.message() + describe_death(c)));
  }
  // Replies are read as they come, so a child that fails early is reported
  // at once rather than after the others' deadline.
  std::vector<Json> replies(children.size());
  std::vector<bool> done(children.size(), false);
  size_t left = children.size();
  while (left > 0) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t k = 0; k < children.size(); ++k) {
      if (done[k]) continue;
      fds.push_back({children_[children[k]].fd, POLLIN, 0});
      which.push_back(k);
    }
    const int wait = ms_left(deadline);
    if (wait == 0) {
      std::string late;
      for (size_t k : which) late += (late.empty() ? "" : ", ") + children_[children[k]].name;
      return fail(Status::io_error("no answer to \"" + what + "\" from " + late + " before the deadline"));
    }
    int r = ::poll(fds.data(), fds.size(), wait);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return fail(Status::io_error(std::string("poll: ") + std::strerror(errno)));
    for (size_t j = 0; j < fds.size(); ++j) {
      if (fds[j].revents == 0) continue;
      const size_t k = which[j];
      Child& c = children_[children[k]];
      Channel ch(c.fd);
      auto reply = ch.receive(deadline);
      if (!reply) {
        return fail(Status::io_error(c.name + " did not answer \"" + what + "\": " + reply.status().message() +
                                     describe_death(c)));
      }
      if (!reply->is_object() || !reply->value("ok", false)) {
        const std::string err = reply->is_object() ? reply->value("error", std::string("no reason given")) : reply->dump();
        return fail(Status::internal(c.name + " failed to " + what + ": " + err));
      }
      replies[k] = std::move(*reply);
      done[k] = true;
      --left;
    }
  }
  return replies;
}

std::vector<ProcessGroup::Answer> ProcessGroup::request_tolerating(const std::vector<size_t>& children,
                                                                 const Json& command, Clock::time_point deadline,
                                                                 size_t victim, Clock::time_point kill_at,
                                                                 int64_t* killed_ns) {
  const std::string what = command.value("cmd", std::string("?"));
  std::vector<Answer> answers(children.size());
  std::vector<bool> done(children.size(), false);
  size_t left = children.size();
  for (size_t k = 0; k < children.size(); ++k) {
    Child& c = children_[children[k]];
    Status s = c.reaped || c.fd < 0 ? Status::io_error("not running") : Channel(c.fd).send(command);
    if (!s.is_ok()) {
      answers[k].error = c.name + ": cannot send \"" + what + "\": " + s.message() + describe_death(c);
      done[k] = true;
      --left;
    }
  }
  bool victim_alive = victim < children_.size() && !children_[victim].reaped;
  while (left > 0 || victim_alive) {
    if (victim_alive && Clock::now() >= kill_at) {
      Child& v = children_[victim];
      if (killed_ns != nullptr) *killed_ns = monotonic_ns();
      v.victim = true;
      ::kill(v.pid, SIGKILL);
      ::waitpid(v.pid, &v.wait_status, 0);
      v.reaped = true;
      victim_alive = false;
      for (size_t k = 0; k < children.size(); ++k) {
        if (children[k] != victim || done[k]) continue;
        answers[k].error = v.name + " was killed (SIGKILL) while it ran \"" + what + "\"";
        done[k] = true;
        --left;
      }
      continue;
    }
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t k = 0; k < children.size(); ++k) {
      if (done[k]) continue;
      fds.push_back({children_[children[k]].fd, POLLIN, 0});
      which.push_back(k);
    }
    Clock::time_point until = deadline;
    if (victim_alive) until = std::min(until, kill_at);
    const int wait = ms_left(until);
    if (Clock::now() >= deadline) {
      for (size_t k : which) {
        answers[k].error = children_[children[k]].name + ": no answer to \"" + what + "\" before the deadline";
        answers[k].late = true;
      }
      break;
    }
    int r = ::poll(fds.data(), fds.size(), wait);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      for (size_t k : which) answers[k].error = std::string("poll: ") + std::strerror(errno);
      break;
    }
    for (size_t j = 0; j < fds.size(); ++j) {
      if (fds[j].revents == 0) continue;
      const size_t k = which[j];
      Child& c = children_[children[k]];
      auto reply = Channel(c.fd).receive(deadline);
      if (!reply) {
        answers[k].error = c.name + " did not answer \"" + what + "\": " + reply.status().message() + describe_death(c);
      } else if (!reply->is_object() || !reply->value("ok", false)) {
        answers[k].error = c.name + " failed to " + what + ": " +
                           (reply->is_object() ? reply->value("error", std::string("no reason given")) : reply->dump());
      } else {
        answers[k].ok = true;
        answers[k].reply = std::move(*reply);
      }
      done[k] = true;
      --left;
    }
  }
  if (victim_alive) {  // the deadline came first
    Child& v = children_[victim];
    if (killed_ns != nullptr) *killed_ns = monotonic_ns();
    v.victim = true;
    ::kill(v.pid, SIGKILL);
    ::waitpid(v.pid, &v.wait_status, 0);
    v.reaped = true;
  }
  return answers;
}

Result<Json> ProcessGroup::request(size_t child, const Json& command, Clock::time_point deadline) {
  auto r = request(std::vector<size_t>{child}, command, deadline);
  if (!r) return r.status();
  return std::move(r->front());
}

Status ProcessGroup::shut_down(Clock::time_point deadline) {
  Status first;
  for (Child& c : children_) {
    if (c.reaped || c.fd < 0) continue;
    Channel(c.fd).send(Json{{"cmd", "exit"}});
  }
  for (Child& c : children_) {
    while (!c.reaped) {
      pid_t r = ::waitpid(c.pid, &c.wait_status, WNOHANG);
      if (r == c.pid) {
        c.reaped = true;
        break;
      }
      if (Clock::now() >= deadline) break;
      ::usleep(2000);
    }
    if (!c.reaped) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &c.wait_status, 0);
      c.reaped = true;
      if (first.is_ok()) first = Status::internal(c.name + " did not exit when asked and was killed");
    } else if (first.is_ok() && !c.victim && !(WIFEXITED(c.wait_status) && WEXITSTATUS(c.wait_status) == 0)) {
      first = Status::internal(c.name + " ended badly" + describe_death(c));
    }
    close_parent_end(&c.fd);
  }
  return first;
}

void ProcessGroup::kill_all() {
  for (Child& c : children_) {
    if (!c.reaped) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &c.wait_status, 0);
      c.reaped = true;
    }
    close_parent_end(&c.fd);
  }
}

}  // namespace refit::bench
