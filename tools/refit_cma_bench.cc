// refit-cma-bench: what the cma fabric's copy costs against a memcpy, by the
// page size of the memory it writes into (docs/refresh.md, "Host memory and
// huge pages"). A child process holds the destination buffer; this process
// writes into it with process_vm_writev, piece by piece, as the fabric does,
// and copies the same bytes into a buffer of its own with memcpy. Each is
// timed over the whole buffer, after one pass that faults every page in; the
// best of --repeat passes is printed, in seconds per GiB.
//
// Exit status: 0 when it measured, 1 when a system call failed (the message
// names it), 2 on bad arguments, 77 when the kernel forbids cross-memory
// attach here (kernel.yama.ptrace_scope; the fabric then falls back to UCX).

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "plugin/host_memory.h"

namespace {

using Clock = std::chrono::steady_clock;

// `bytes` on huge pages (as the agents allocate) or on small pages
// (MADV_NOHUGEPAGE), every page touched.
std::shared_ptr<uint8_t> buffer(uint64_t bytes, bool huge) {
  std::shared_ptr<uint8_t> p;
  if (huge) {
    p = refit::plugin::map_host_memory(bytes);
  } else {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
      madvise(m, bytes, MADV_NOHUGEPAGE);
      p = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(m), [bytes](uint8_t* q) { munmap(q, bytes); });
    }
  }
  if (p) std::memset(p.get(), 1, bytes);
  return p;
}

struct Child {
  pid_t pid = -1;
  uint64_t address = 0;
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// Forks a child that holds `bytes` of destination memory until killed, and
// learns its address over a pipe.
bool start_child(uint64_t bytes, bool huge, Child* child) {
  int fds[2];
  if (::pipe(fds) != 0) return false;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    std::shared_ptr<uint8_t> dst = buffer(bytes, huge);
    uint64_t address = reinterpret_cast<uint64_t>(dst.get());
    if (::write(fds[1], &address, sizeof address) != sizeof address) ::_exit(1);
    for (;;) ::pause();
  }
  ::close(fds[1]);
  child->pid = pid;
  const bool ok = ::read(fds[0], &child->address, sizeof child->address) == sizeof child->address &&
                  child->address != 0;
  ::close(fds[0]);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 1024, piece_kib = 1024;
  int repeat = 3;
  bool small_source = false;
  CLI::App app(
      "refit-cma-bench: the cma fabric's copy (process_vm_writev into another process) against\n"
      "a memcpy, into 4 KiB pages and into transparent huge pages. Prints seconds per GiB,\n"
      "the best of --repeat passes over the buffer, each after a pass that faults the pages in.",
      "refit-cma-bench");
  app.add_option("--mib", mib, "destination buffer size in MiB (default 1024)")->check(CLI::Range(2, 1 << 20));
  app.add_option("--piece-kib", piece_kib, "bytes per system call or memcpy, in KiB (default 1024)")
      ->check(CLI::Range(4, 1 << 20));
  app.add_option("--repeat", repeat, "passes per figure (default 3)")->check(CLI::Range(1, 100));
  app.add_flag("--small-source", small_source, "the source buffer on 4 KiB pages (default: huge pages)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  const uint64_t bytes = mib << 20, piece = piece_kib << 10;
  if (piece > bytes) {
    std::fprintf(stderr, "refit-cma-bench: --piece-kib is larger than the buffer\n");
    return 2;
  }
  std::shared_ptr<uint8_t> src = buffer(bytes, !small_source);
  if (!src) {
    std::fprintf(stderr, "refit-cma-bench: cannot allocate %llu MiB\n", static_cast<unsigned long long>(mib));
    return 1;
  }
  std::printf("%llu MiB in pieces of %llu KiB from a source on %s, seconds per GiB, best of %d\n",
              static_cast<unsigned long long>(mib), static_cast<unsigned long long>(piece_kib),
              small_source ? "4 KiB pages" : "huge pages", repeat);
  std::printf("%-20s %18s %10s\n", "destination pages", "process_vm_writev", "memcpy");
  const double gib = static_cast<double>(bytes) / static_cast<double>(1ull << 30);
  for (bool huge : {false, true}) {
    Child child;
    if (!start_child(bytes, huge, &child)) {
      std::fprintf(stderr, "refit-cma-bench: starting the child: %s\n", std::strerror(errno));
      return 1;
    }
    std::shared_ptr<uint8_t> local = buffer(bytes, huge);
    if (!local) {
      std::fprintf(stderr, "refit-cma-bench: cannot allocate %llu MiB\n", static_cast<unsigned long long>(mib));
      return 1;
    }
    double best_cma = 1e30, best_copy = 1e30;
    for (int pass = 0; pass <= repeat; ++pass) {  // pass 0 warms up
      const auto t0 = Clock::now();
      for (uint64_t off = 0; off < bytes; off += piece) {
        const uint64_t n = std::min(piece, bytes - off);
        struct iovec l{src.get() + off, n};
        struct iovec r{reinterpret_cast<void*>(child.address + off), n};
        const ssize_t w = ::process_vm_writev(child.pid, &l, 1, &r, 1, 0);
        if (w != static_cast<ssize_t>(n)) {
          const int err = errno;
          std::fprintf(stderr, "refit-cma-bench: process_vm_writev: %s\n", w < 0 ? std::strerror(err) : "short write");
          return w < 0 && err == EPERM ? 77 : 1;
        }
      }
      const auto t1 = Clock::now();
      for (uint64_t off = 0; off < bytes; off += piece)
        std::memcpy(local.get() + off, src.get() + off, std::min(piece, bytes - off));
      const auto t2 = Clock::now();
      if (pass == 0) continue;
      best_cma = std::min(best_cma, std::chrono::duration<double>(t1 - t0).count() / gib);
      best_copy = std::min(best_copy, std::chrono::duration<double>(t2 - t1).count() / gib);
    }
    std::printf("%-20s %18.3f %10.3f\n", huge ? "2 MiB (THP)" : "4 KiB", best_cma, best_copy);
  }
  return 0;
}
