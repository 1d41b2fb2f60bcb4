// The cores the planner's and the simulator's threads count: the CPU
// affinity, lowered to the cgroup's CPU quota. The parsing is checked on
// cgroup folders written here (v1 and v2 layouts); the affinity and a real
// cgroup v1 quota are checked in a forked child, where the machine lets the
// test set them.

#include "planner/cores.h"

#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace refit {
namespace {

namespace fs = std::filesystem;

// A folder of fake cgroup files, removed at the end.
class CgroupTree {
 public:
  CgroupTree() {
    root_ = fs::temp_directory_path() / ("refit-cores-" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  ~CgroupTree() { fs::remove_all(root_); }
  void write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root() const { return root_.string(); }

 private:
  fs::path root_;
};

TEST(Cores, WithoutACgroupQuotaTheAffinityCounts) {
  CgroupTree t;
  EXPECT_EQ(usable_cores_from(6, "", t.root()), 6);
  EXPECT_EQ(usable_cores_from(6, "0::/\n", t.root()), 6);  // no cpu.max at all
  t.write("cpu.max", "max 100000\n");
  EXPECT_EQ(usable_cores_from(6, "0::/\n", t.root()), 6);
  EXPECT_EQ(usable_cores_from(0, "", t.root()), 1);  // never below one
}

TEST(Cores, CgroupV2QuotaRoundsUpAndTheSmallestOnThePathWins) {
  CgroupTree t;
  t.write("kubepods/pod1/ctr/cpu.max", "max 100000\n");
  t.write("kubepods/pod1/cpu.max", "250000 100000\n");  // 2.5 CPUs: 3 threads
  t.write("kubepods/cpu.max", "1600000 100000\n");
  EXPECT_EQ(usable_cores_from(64, "0::/kubepods/pod1/ctr\n", t.root()), 3);
  // A quota above the affinity leaves the affinity.
  EXPECT_EQ(usable_cores_from(2, "0::/kubepods/pod1/ctr\n", t.root()), 2);
  // Inside a cgroup namespace the process's own cgroup is "/" at the root.
  CgroupTree ns;
  ns.write("cpu.max", "50000 100000\n");  // half a CPU: one thread
  EXPECT_EQ(usable_cores_from(64, "0::/\n", ns.root()), 1);
}

TEST(Cores, CgroupV1QuotaUnderEitherMountName) {
  CgroupTree t;
  t.write("cpu,cpuacct/job/step/cpu.cfs_quota_us", "-1\n");
  t.write("cpu,cpuacct/job/step/cpu.cfs_period_us", "100000\n");
  t.write("cpu,cpuacct/job/cpu.cfs_quota_us", "400000\n");
  t.write("cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  const char* self = "12:memory:/job/step\n4:cpu,cpuacct:/job/step\n0::/\n";
  EXPECT_EQ(usable_cores_from(32, self, t.root()), 4);
  CgroupTree plain;
  plain.write("cpu/job/cpu.cfs_quota_us", "150000\n");
  plain.write("cpu/job/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(usable_cores_from(32, "3:cpuacct,cpu:/job\n", plain.root()), 2);
  // "cpuset" is not "cpu".
  EXPECT_EQ(usable_cores_from(32, "5:cpuset:/job\n", plain.root()), 32);
}

TEST(Cores, UnreadableOrOddFilesLimitNothing) {
  CgroupTree t;
  t.write("a/cpu.max", "garbage\n");
  t.write("b/cpu.max", "0 100000\n");
  t.write("c/cpu.max", "100000 0\n");
  t.write("d/cpu.max", "");
  for (const char* p : {"0::/a\n", "0::/b\n", "0::/c\n", "0::/d\n", "0::/missing\n", "nonsense\n", ":::\n"})
    EXPECT_EQ(usable_cores_from(5, p, t.root()), 5) << p;
}

// Runs `body` in a forked child; its exit status (0: passed).
template <typename Body>
int in_child(const Body& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

TEST(Cores, AProcessPinnedToOneCpuUsesOne) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "this machine lets the test use one CPU only";
  EXPECT_GE(usable_cores(), 1);
  const int rc = in_child([&] {
    int first = 0;
    while (!CPU_ISSET(first, &all)) ++first;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    if (sched_setaffinity(0, sizeof(one), &one) != 0) return 2;
    return usable_cores() == 1 ? 0 : 1;
  });
  EXPECT_EQ(rc, 0) << "usable_cores() in a process pinned to one CPU";
}

// A real cgroup v1 CPU quota of one CPU on a machine with two or more:
// needs root and the v1 cpu controller mounted (skipped otherwise).
TEST(Cores, ARealCgroupV1QuotaOfOneCpuUsesOne) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "this machine lets the test use one CPU only";
  std::string mount;
  for (const char* m : {"/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"})
    if (access((std::string(m) + "/cpu.cfs_quota_us").c_str(), F_OK) == 0) mount = m;
  if (mount.empty() || geteuid() != 0) GTEST_SKIP() << "no cgroup v1 cpu controller this test may change";
  const std::string dir = mount + "/refit-cores-test-" + std::to_string(getpid());
  if (mkdir(dir.c_str(), 0755) != 0) GTEST_SKIP() << "cannot make " << dir;
  {
    std::ofstream(dir + "/cpu.cfs_period_us") << "100000\n";
    std::ofstream(dir + "/cpu.cfs_quota_us") << "100000\n";
  }
  const int rc = in_child([&] {
    {
      std::ofstream procs(dir + "/cgroup.procs");
      procs << getpid() << "\n";
      procs.flush();
      if (!procs) return 2;
    }
    return usable_cores() == 1 ? 0 : 1;
  });
  rmdir(dir.c_str());  // empty once the child has exited
  EXPECT_EQ(rc, 0) << "usable_cores() in a cgroup with a quota of one CPU";
}

}  // namespace
}  // namespace refit
