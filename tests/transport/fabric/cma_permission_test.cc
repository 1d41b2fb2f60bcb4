// Which process a cma rank lets attach under Yama's ptrace_scope 1
// (cma_fabric.h): the peer itself, or several peers' nearest common
// ancestor, never "any process". Real processes: a launcher that starts two
// ranks, as torchrun or refit-bench do.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "transport/fabric/cma_fabric.h"

namespace refit::fabric {
namespace {

struct Launcher {
  pid_t pid = -1;
  pid_t ranks[2] = {-1, -1};
  int fd = -1;
};

// Forks a launcher that forks two ranks (each sleeps until killed) and
// reports their pids on a pipe.
bool start_launcher(Launcher* l) {
  int p[2];
  if (::pipe(p) != 0) return false;
  l->pid = ::fork();
  if (l->pid < 0) return false;
  if (l->pid == 0) {
    ::close(p[0]);
    pid_t kids[2];
    for (pid_t& k : kids) {
      k = ::fork();
      if (k == 0) {
        ::pause();
        ::_exit(0);
      }
    }
    if (::write(p[1], kids, sizeof kids) != sizeof kids) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  ::close(p[1]);
  const bool ok = ::read(p[0], l->ranks, sizeof l->ranks) == sizeof l->ranks;
  ::close(p[0]);
  return ok;
}

void stop(Launcher* l) {
  for (pid_t k : l->ranks) {
    if (k > 0) ::kill(k, SIGKILL);
  }
  if (l->pid > 0) {
    ::kill(l->pid, SIGKILL);
    ::waitpid(l->pid, nullptr, 0);
  }
}

TEST(CmaPermission, OnePeerIsAdmittedByItsPid) {
  Launcher l;
  ASSERT_TRUE(start_launcher(&l));
  Result<int> t = cma_tracer_for({l.ranks[0]});
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ(*t, l.ranks[0]);
  stop(&l);
}

TEST(CmaPermission, SeveralPeersAreAdmittedThroughTheirLauncher) {
  Launcher l;
  ASSERT_TRUE(start_launcher(&l));
  Result<int> t = cma_tracer_for({l.ranks[0], l.ranks[1]});
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ(*t, l.pid);  // not this test process, not init
  stop(&l);
}

TEST(CmaPermission, NoPeerDeclaresNothing) {
  Result<int> t = cma_tracer_for({});
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(*t, 0);
}

TEST(CmaPermission, PeersSharingOnlyInitAreRefusedWithAReason) {
  Launcher l;
  ASSERT_TRUE(start_launcher(&l));
  Result<int> t = cma_tracer_for({1, l.ranks[0]});
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("no launcher below init"), std::string::npos) << t.status().message();
  stop(&l);
}

}  // namespace
}  // namespace refit::fabric
