// The cores the planner's and the simulator's threads count: the CPU
// affinity, lowered to the cgroup's CPU quota. The parsing is checked on
// cgroup folders written here (v1 and v2, mounted whole or a container's
// own cgroup alone), described by mountinfo text as the kernel writes it;
// the affinity and a real cgroup v1 quota are checked in a forked child,
// where the machine lets the test set them.

#include "planner/cores.h"

#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace refit {
namespace {

namespace fs = std::filesystem;

// A folder of its own for written cgroup files, removed at the end.
class CgroupTree {
 public:
  CgroupTree() {
    // mkdtemp replaces the trailing six X with a unique suffix.
    std::string t = (fs::temp_directory_path() / "refit-cores-XXXXXX").string();
    if (mkdtemp(t.data()) != nullptr) root_ = t;
  }
  ~CgroupTree() {
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }
  void write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  // A mountinfo line for folder `rel` of the tree, mounted as a cgroup
  // (`v1_options` its super options, e.g. "rw,cpu,cpuacct") or as cgroup2
  // (`v1_options` empty), showing the cgroup `shows`.
  std::string mount(const std::string& rel, const std::string& shows, const std::string& v1_options) const {
    const std::string point = (root_ / rel).string();
    return v1_options.empty()
               ? "40 31 0:27 " + shows + " " + point + " rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
               : "41 31 0:29 " + shows + " " + point + " rw,nosuid shared:9 - cgroup cgroup " + v1_options + "\n";
  }

 private:
  fs::path root_;
};

const char* kProcMounts = "22 27 0:21 / /proc rw,relatime - proc proc rw\n";

TEST(Cores, WithoutACgroupQuotaTheAffinityCounts) {
  CgroupTree t;
  const std::string v2 = t.mount("", "/", "");
  EXPECT_EQ(usable_cores_from(6, "", v2), 6);
  EXPECT_EQ(usable_cores_from(6, "0::/\n", v2), 6);  // no cpu.max at all
  t.write("cpu.max", "max 100000\n");
  EXPECT_EQ(usable_cores_from(6, "0::/\n", v2), 6);
  EXPECT_EQ(usable_cores_from(6, "0::/\n", kProcMounts), 6);  // no cgroup mounted
  EXPECT_EQ(usable_cores_from(0, "", v2), 1);                  // never below one
}

TEST(Cores, CgroupV2QuotaRoundsUpAndTheSmallestOnThePathWins) {
  CgroupTree t;
  t.write("kubepods/pod1/ctr/cpu.max", "max 100000\n");
  t.write("kubepods/pod1/cpu.max", "250000 100000\n");  // 2.5 CPUs: 3 threads
  t.write("kubepods/cpu.max", "1600000 100000\n");
  const std::string v2 = std::string(kProcMounts) + t.mount("", "/", "");
  EXPECT_EQ(usable_cores_from(64, "0::/kubepods/pod1/ctr\n", v2), 3);
  EXPECT_EQ(usable_cores_from(64, "0::/kubepods/pod1/ctr/\n", v2), 3);
  // A quota above the affinity leaves the affinity.
  EXPECT_EQ(usable_cores_from(2, "0::/kubepods/pod1/ctr\n", v2), 2);
  // A tiny quota is one thread; a huge one limits nothing.
  CgroupTree tiny;
  tiny.write("a/cpu.max", "1000 100000\n");
  tiny.write("b/cpu.max", "9223372036854775807 100000\n");
  EXPECT_EQ(usable_cores_from(64, "0::/a\n", tiny.mount("", "/", "")), 1);
  EXPECT_EQ(usable_cores_from(64, "0::/b\n", tiny.mount("", "/", "")), 64);
}

TEST(Cores, ACgroupNamespaceOrABindMountShowsTheContainersOwnCgroup) {
  // In a cgroup namespace the process's cgroup is "/", the mount's root.
  CgroupTree ns;
  ns.write("cpu.max", "50000 100000\n");  // half a CPU: one thread
  EXPECT_EQ(usable_cores_from(64, "0::/\n", ns.mount("", "/", "")), 1);
  // Without one (docker on cgroup v1), the process's path is the host's
  // and the mount shows that cgroup at its mount point: the quota is read
  // there, not under a folder of the path's name.
  CgroupTree bind;
  bind.write("cpu/cpu.cfs_quota_us", "200000\n");
  bind.write("cpu/cpu.cfs_period_us", "100000\n");
  bind.write("cpu/docker/abc/cpu.cfs_quota_us", "800000\n");  // a decoy under the mount
  bind.write("cpu/docker/abc/cpu.cfs_period_us", "100000\n");
  const std::string mounts = bind.mount("cpu", "/docker/abc", "rw,cpu,cpuacct");
  EXPECT_EQ(usable_cores_from(64, "4:cpu,cpuacct:/docker/abc\n", mounts), 2);
  // A cgroup under the one the mount shows: it, and the mount's.
  bind.write("cpu/sub/cpu.cfs_quota_us", "100000\n");
  bind.write("cpu/sub/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(usable_cores_from(64, "4:cpu,cpuacct:/docker/abc/sub\n", mounts), 1);
  // A cgroup the mount does not show, or one outside the namespace, limits nothing.
  EXPECT_EQ(usable_cores_from(64, "4:cpu,cpuacct:/docker/other\n", mounts), 64);
  EXPECT_EQ(usable_cores_from(64, "4:cpu,cpuacct:/docker/abcd\n", mounts), 64);
  EXPECT_EQ(usable_cores_from(64, "0::/../sibling\n", ns.mount("", "/", "")), 64);
}

TEST(Cores, CgroupV1QuotaWhereverTheCpuControllerIsMounted) {
  CgroupTree t;
  t.write("cpu,cpuacct/job/step/cpu.cfs_quota_us", "-1\n");
  t.write("cpu,cpuacct/job/step/cpu.cfs_period_us", "100000\n");
  t.write("cpu,cpuacct/job/cpu.cfs_quota_us", "400000\n");
  t.write("cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  const std::string hybrid = std::string(kProcMounts) + t.mount("unified", "/", "") +
                             t.mount("cpu,cpuacct", "/", "rw,cpu,cpuacct") + t.mount("cpuset", "/", "rw,cpuset");
  const char* self = "12:memory:/job/step\n5:cpuset:/job\n4:cpu,cpuacct:/job/step\n0::/\n";
  EXPECT_EQ(usable_cores_from(32, self, hybrid), 4);
  // "cpuacct" alone, "cpuset" and "name=cpu" are not the cpu controller.
  EXPECT_EQ(usable_cores_from(32, "4:cpuacct:/job/step\n5:cpuset:/job\n1:name=cpu:/job\n", hybrid), 32);
  EXPECT_EQ(usable_cores_from(32, self, t.mount("cpu,cpuacct", "/", "rw,cpuacct")), 32);  // no cpu there
}

TEST(Cores, OddLinesAndFilesLimitNothing) {
  CgroupTree t;
  t.write("cpu.max", "100000 100000\n");  // the root's quota: one CPU, read only for a v2 line
  t.write("a/cpu.max", "garbage\n");
  t.write("b/cpu.max", "0 100000\n");
  t.write("c/cpu.max", "100000 0\n");
  t.write("d/cpu.max", "");
  const std::string v2 = t.mount("", "/", "");
  EXPECT_EQ(usable_cores_from(5, "0::/a\n", v2), 1);  // the root's quota still counts
  for (const char* self : {"nonsense\n", ":::\n", "::\n", "7::/\n", "0::relative\n", "0:cpu\n"})
    EXPECT_EQ(usable_cores_from(5, self, v2), 5) << self;
  CgroupTree odd;
  odd.write("a/cpu.max", "garbage\n");
  odd.write("b/cpu.max", "0 100000\n");
  odd.write("c/cpu.max", "100000 0\n");
  odd.write("d/cpu.max", "");
  for (const char* self : {"0::/a\n", "0::/b\n", "0::/c\n", "0::/d\n", "0::/missing\n"})
    EXPECT_EQ(usable_cores_from(5, self, odd.mount("", "/", "")), 5) << self;
  for (const char* mounts : {"", "garbage\n", "1 2 3\n", "41 31 0:29 / /x rw - cgroup\n"})
    EXPECT_EQ(usable_cores_from(5, "0::/\n", mounts), 5) << mounts;
}

TEST(Cores, MountinfoEscapesInAMountPoint) {
  CgroupTree t;
  t.write("with space/cpu.max", "200000 100000\n");
  std::string line = t.mount("with space", "/", "");
  const size_t at = line.find("with space");
  line.replace(at, 10, "with\\040space");
  EXPECT_EQ(usable_cores_from(8, "0::/\n", line), 2);
}

// Runs `body` in a forked child, killed after 20 s; its exit status (0:
// passed), or -1 when it did not exit.
template <typename Body>
int in_child(const Body& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(20);
    _exit(body());
  }
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

// A real cgroup v1 CPU quota of one CPU, in a cgroup made under this
// process's own: needs two CPUs, the v1 cpu controller mounted whole at
// /sys/fs/cgroup/cpu (or cpu,cpuacct) and the right to make a cgroup
// there and move a process into it (skipped otherwise).
TEST(Cores, ARealCgroupV1QuotaOfOneCpuUsesOne) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "this machine lets the test use one CPU only";
  std::string mount;
  for (const char* m : {"/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"})
    if (access((std::string(m) + "/cpu.cfs_quota_us").c_str(), W_OK) == 0) mount = m;
  std::string own;
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    const std::string controllers = line.substr(a + 1, b - a - 1);
    if (controllers == "cpu" || controllers == "cpu,cpuacct" || controllers == "cpuacct,cpu") own = line.substr(b + 1);
  }
  if (mount.empty() || own.empty()) GTEST_SKIP() << "no cgroup v1 cpu controller this test may change";
  if (own == "/") own.clear();
  const std::string dir = mount + own + "/refit-cores-test-" + std::to_string(getpid());
  if (mkdir(dir.c_str(), 0755) != 0) GTEST_SKIP() << "cannot make " << dir;
  struct Remove {
    std::string dir;
    ~Remove() { EXPECT_EQ(rmdir(dir.c_str()), 0) << "removing " << dir; }  // empty once the child exited
  } remove{dir};
  for (auto [file, value] : {std::pair{"/cpu.cfs_period_us", "100000"}, std::pair{"/cpu.cfs_quota_us", "100000"}}) {
    std::ofstream f(dir + file);
    f << value << "\n";
    f.flush();
    if (!f) GTEST_SKIP() << "cannot write " << dir << file;
  }
  const int rc = in_child([&] {
    std::ofstream procs(dir + "/cgroup.procs");
    procs << getpid() << "\n";
    procs.flush();
    if (!procs) return 2;
    return usable_cores() == 1 ? 0 : 1;
  });
  if (rc == 2) GTEST_SKIP() << "cannot move a process into " << dir;
  EXPECT_EQ(rc, 0) << "usable_cores() in a cgroup with a quota of one CPU";
}

}  // namespace
}  // namespace refit
