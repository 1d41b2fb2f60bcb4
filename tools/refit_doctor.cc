// refit-doctor: checks what this machine must offer before an agent runs on
// it, and prints one line per check with what to do about a problem.
//
//   refit-doctor [--config F] [--role receiver|source] [--json F]
//
// With --config the checks follow that agent configuration (the keys of
// include/refit/refit.h): its transports and devices, its local fabric, its
// coordinator and token file. Without one they follow the defaults of a
// receiver and skip the coordinator.
//
// Exit status: 0 when everything the configuration needs is there (warnings
// allowed), 1 when a needed check failed, 2 on bad input (a config that does
// not parse, names an unknown key, or cannot be read).

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <uct/api/uct.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "plugin/config.h"
#include "transport/control/auth.h"
#include "transport/control/client.h"
#include "transport/ucx/context.h"

namespace {

using refit::plugin::AgentConfig;

constexpr int kExitFailed = 1;
constexpr int kExitBadInput = 2;

enum class Outcome { kOk, kWarn, kFail, kSkip };

struct Check {
  std::string name;
  Outcome outcome = Outcome::kOk;
  std::string detail;  // what was found
  std::string advice;  // what to do (empty when nothing is to be done)
};

const char* label(Outcome o) {
  switch (o) {
    case Outcome::kOk: return " ok ";
    case Outcome::kWarn: return "warn";
    case Outcome::kFail: return "FAIL";
    case Outcome::kSkip: return "skip";
  }
  return "?";
}

const char* json_label(Outcome o) {
  switch (o) {
    case Outcome::kOk: return "ok";
    case Outcome::kWarn: return "warn";
    case Outcome::kFail: return "fail";
    case Outcome::kSkip: return "skip";
  }
  return "?";
}

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return {};
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// The effective capability set of this process (/proc/self/status CapEff).
uint64_t effective_caps() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("CapEff:", 0) == 0) return std::stoull(line.substr(7), nullptr, 16);
  }
  return 0;
}
constexpr int kCapIpcLock = 14;
constexpr int kCapSysPtrace = 19;
bool has_cap(int cap) { return (effective_caps() >> cap) & 1u; }

// Whether a sibling process can read another's memory with
// process_vm_readv, the way the cma fabric's ranks write into each other:
// two forked children, the target allowing the reader as its ptracer (as
// the fabric does under Yama scope 1), the reader copying 8 bytes. Returns
// an empty string on success, else what failed.
std::string probe_cross_memory_attach() {
  int to_target[2], to_reader[2];
  if (pipe(to_target) != 0) return std::string("pipe: ") + std::strerror(errno);
  if (pipe(to_reader) != 0) {
    close(to_target[0]);
    close(to_target[1]);
    return std::string("pipe: ") + std::strerror(errno);
  }
  static uint64_t secret = 0x7265666974646f63ull;  // the value the reader must see
  const pid_t target = fork();
  if (target < 0) return std::string("fork: ") + std::strerror(errno);
  if (target == 0) {
    close(to_target[1]);
    close(to_reader[0]);
    pid_t reader = 0;
    if (read(to_target[0], &reader, sizeof reader) != sizeof reader) _exit(3);
    prctl(PR_SET_PTRACER, static_cast<unsigned long>(reader), 0, 0, 0);  // only matters under scope 1
    uint64_t address = reinterpret_cast<uint64_t>(&secret);
    if (write(to_reader[1], &address, sizeof address) != sizeof address) _exit(3);
    char done = 0;
    (void)!read(to_target[0], &done, 1);  // returns when the reader is done (or the pipe closes)
    _exit(0);
  }
  const pid_t reader = fork();
  if (reader < 0) {
    kill(target, SIGKILL);
    waitpid(target, nullptr, 0);
    return std::string("fork: ") + std::strerror(errno);
  }
  if (reader == 0) {
    close(to_reader[1]);
    uint64_t address = 0;
    if (read(to_reader[0], &address, sizeof address) != sizeof address) _exit(3);
    uint64_t got = 0;
    iovec local{&got, sizeof got};
    iovec remote{reinterpret_cast<void*>(address), sizeof got};
    const ssize_t n = process_vm_readv(target, &local, 1, &remote, 1, 0);
    const int err = errno;
    char done = 1;
    (void)!write(to_target[1], &done, 1);
    if (n != static_cast<ssize_t>(sizeof got)) _exit(err == EPERM ? 10 : err == ENOSYS ? 11 : 12);
    _exit(got == secret ? 0 : 13);
  }
  close(to_target[0]);
  close(to_reader[0]);
  close(to_reader[1]);
  (void)!write(to_target[1], &reader, sizeof reader);
  int reader_status = 0;
  // Both children end on their own within milliseconds; a bounded wait
  // keeps a stuck one from hanging the doctor.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  pid_t done = 0;
  while ((done = waitpid(reader, &reader_status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    usleep(10000);
  }
  if (done == 0) {
    kill(reader, SIGKILL);
    waitpid(reader, &reader_status, 0);
  }
  close(to_target[1]);
  kill(target, SIGKILL);
  waitpid(target, nullptr, 0);
  if (done == 0) return "the probe did not finish within 5 s";
  if (!WIFEXITED(reader_status)) return "the probe process was killed";
  switch (WEXITSTATUS(reader_status)) {
    case 0: return {};
    case 10: return "process_vm_readv between sibling processes: EPERM";
    case 11: return "process_vm_readv: ENOSYS (the kernel has no cross-memory attach)";
    case 13: return "process_vm_readv read the wrong bytes";
    default: return "process_vm_readv between sibling processes failed";
  }
}

Check check_cma(const AgentConfig& config, bool needed) {
  Check c{"cma"};
  const std::string scope_text = read_first_line("/proc/sys/kernel/yama/ptrace_scope");
  const int scope = scope_text.empty() ? 0 : std::atoi(scope_text.c_str());
  const bool ptrace_cap = has_cap(kCapSysPtrace);
  std::ostringstream d;
  d << "kernel.yama.ptrace_scope = " << (scope_text.empty() ? "absent (no Yama)" : scope_text)
    << ", CAP_SYS_PTRACE " << (ptrace_cap ? "held" : "not held");
  const std::string probe = probe_cross_memory_attach();
  if (probe.empty()) {
    d << "; a sibling process read another's memory with process_vm_readv";
    c.detail = d.str();
    return c;
  }
  d << "; " << probe;
  c.detail = d.str();
  c.outcome = needed ? Outcome::kFail : Outcome::kWarn;
  if (scope >= 3) {
    c.advice = "scope 3 forbids cross-memory attach until reboot; use \"local\": {\"fabric\": \"ucx\"} "
               "(or boot without kernel.yama.ptrace_scope=3)";
  } else if (scope == 2) {
    c.advice = "scope 2 needs CAP_SYS_PTRACE: run the server with it (docker --cap-add SYS_PTRACE), "
               "set `sysctl kernel.yama.ptrace_scope=1`, or use \"local\": {\"fabric\": \"ucx\"}";
  } else {
    c.advice = "ranks of a domain must run as one user in one pid namespace (a container per host, not "
               "per rank), and seccomp must allow process_vm_readv/writev; or use \"local\": {\"fabric\": \"ucx\"}";
  }
  (void)config;
  return c;
}

bool needs_rdma_registration(const AgentConfig& config) {
  static const std::set<std::string> kRdma = {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x",
                                              "dc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5",
                                              "ib", "all"};
  for (const auto& t : config.network.transports) {
    if (kRdma.count(t)) return true;
  }
  return config.network.transports.empty();  // UCX's default is every transport, RDMA included
}

Check check_memlock(const AgentConfig& config) {
  Check c{"memlock"};
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  const bool unlimited = rl.rlim_cur == RLIM_INFINITY;
  const bool ipc_lock = has_cap(kCapIpcLock);
  std::ostringstream d;
  d << "RLIMIT_MEMLOCK " << (unlimited ? std::string("unlimited") : std::to_string(rl.rlim_cur >> 10) + " KiB")
    << ", CAP_IPC_LOCK " << (ipc_lock ? "held" : "not held");
  c.detail = d.str();
  if (unlimited || ipc_lock) return c;
  if (needs_rdma_registration(config)) {
    // RDMA registration pins every shard and buffer; a small limit fails
    // ucp_mem_map at the first large tensor.
    c.outcome = Outcome::kFail;
    c.advice = "RDMA transports pin the registered memory: set `ulimit -l unlimited` (systemd LimitMEMLOCK=infinity, "
               "docker --ulimit memlock=-1) or grant CAP_IPC_LOCK";
  } else {
    c.detail += " (tcp and shared memory do not pin)";
  }
  return c;
}

Check check_thp() {
  Check c{"hugepages"};
  const std::string thp = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  if (thp.empty()) {
    c.outcome = Outcome::kWarn;
    c.detail = "transparent huge pages: not available";
    c.advice = "host copies (staging, cma) run about 2x slower into 4 KiB pages (docs/refresh.md)";
    return c;
  }
  c.detail = "transparent_hugepage/enabled: " + thp;
  if (thp.find("[never]") != std::string::npos) {
    c.outcome = Outcome::kWarn;
    c.advice = "refit asks for huge pages with madvise; `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` "
               "makes host copies about 2x faster (docs/refresh.md)";
  }
  return c;
}

// Every (transport, device) UCX's transport layer reports on this machine.
std::vector<std::pair<std::string, std::string>> uct_resources() {
  std::vector<std::pair<std::string, std::string>> out;
  uct_component_h* components = nullptr;
  unsigned n = 0;
  if (uct_query_components(&components, &n) != UCS_OK) return out;
  for (unsigned i = 0; i < n; ++i) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[i], &attr) != UCS_OK) continue;
    std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds.data();
    if (uct_component_query(components[i], &attr) != UCS_OK) continue;
    for (const auto& md_desc : mds) {
      uct_md_config_t* md_config = nullptr;
      if (uct_md_config_read(components[i], nullptr, nullptr, &md_config) != UCS_OK) continue;
      uct_md_h md = nullptr;
      const ucs_status_t st = uct_md_open(components[i], md_desc.md_name, md_config, &md);
      uct_config_release(md_config);
      if (st != UCS_OK) continue;
      uct_tl_resource_desc_t* tls = nullptr;
      unsigned ntl = 0;
      if (uct_md_query_tl_resources(md, &tls, &ntl) == UCS_OK) {
        for (unsigned t = 0; t < ntl; ++t) out.emplace_back(tls[t].tl_name, tls[t].dev_name);
        uct_release_tl_resource_list(tls);
      }
      uct_md_close(md);
    }
  }
  uct_release_component_list(components);
  return out;
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

Check check_ucx_version() {
  Check c{"ucx"};
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  std::map<std::string, std::set<std::string>> by_tl;
  for (const auto& [tl, dev] : uct_resources()) by_tl[tl].insert(dev);
  std::vector<std::string> parts;
  for (const auto& [tl, devs] : by_tl) {
    parts.push_back(tl + "(" + join(std::vector<std::string>(devs.begin(), devs.end()), " ") + ")");
  }
  c.detail = "UCX " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release) +
             "; transports: " + (parts.empty() ? "none" : join(parts, " "));
  if (major == 1 && minor < 13) {
    c.outcome = Outcome::kFail;
    c.advice = "refit needs UCX 1.13 or later";
  }
  return c;
}

// A configured device: it exists and is up (a network interface under
// /sys/class/net, or an RDMA port "mlx5_0:1" under /sys/class/infiniband).
Check check_device(const std::string& device) {
  Check c{"device"};
  const size_t colon = device.find(':');
  if (colon != std::string::npos) {
    const std::string hca = device.substr(0, colon), port = device.substr(colon + 1);
    const std::string state = read_first_line("/sys/class/infiniband/" + hca + "/ports/" + port + "/state");
    if (state.empty()) {
      c.outcome = Outcome::kFail;
      c.detail = "RDMA port \"" + device + "\" does not exist";
      c.advice = "name a port that `ibv_devinfo` lists, as HCA:PORT, in \"network.devices\"";
    } else {
      c.detail = "RDMA port \"" + device + "\": " + state;
      if (state.find("ACTIVE") == std::string::npos) {
        c.outcome = Outcome::kFail;
        c.advice = "the port is not ACTIVE: check its cable and the subnet manager (`ibstat`)";
      }
    }
    return c;
  }
  const std::string oper = read_first_line("/sys/class/net/" + device + "/operstate");
  if (oper.empty()) {
    c.outcome = Outcome::kFail;
    c.detail = "network interface \"" + device + "\" does not exist";
    c.advice = "name an interface that `ip link` lists in \"network.devices\"";
    return c;
  }
  const std::string flags_text = read_first_line("/sys/class/net/" + device + "/flags");
  const unsigned long flags = flags_text.empty() ? 0 : std::strtoul(flags_text.c_str(), nullptr, 16);
  const bool up = (flags & 0x1) != 0;  // IFF_UP; loopback reports operstate "unknown" while up
  c.detail = "network interface \"" + device + "\": operstate " + oper + (up ? ", up" : ", down");
  if (!up || oper == "down" || oper == "lowerlayerdown") {
    c.outcome = Outcome::kFail;
    c.advice = "bring it up (`ip link set " + device + " up`) or name another interface";
  }
  return c;
}

// The UCX context refit itself creates from "network": the same call the
// agents make, so what fails here fails there with the same message.
Check check_network_context(const AgentConfig& config) {
  Check c{"network"};
  refit::ucx::ContextConfig cc;
  cc.name = "network";
  cc.transports = config.network.transports;
  cc.devices = config.network.devices;
  auto context = refit::ucx::Context::create(cc);
  if (!context.is_ok()) {
    c.outcome = Outcome::kFail;
    c.detail = context.status().message();
    c.advice = "fix \"network.transports\" / \"network.devices\" (`ucx_info -d` lists what UCX has here)";
    return c;
  }
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  ucp_context_query(context->get(), &attr);
  const bool cuda = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  c.detail = "transports [" + join(config.network.transports) + "] devices [" +
             (config.network.devices.empty() ? std::string("all") : join(config.network.devices)) +
             "] open; GPU memory " + (cuda ? "registered directly" : "not supported by this UCX build (GETs into GPU "
             "buffers land in pinned host slots: \"landing_bytes\")");
  return c;
}

template <typename F>
F symbol(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

Check check_cuda(bool needed) {
  Check c{"cuda"};
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    c.outcome = needed ? Outcome::kFail : Outcome::kSkip;
    c.detail = "no CUDA driver (libcuda.so.1 not found)";
    if (needed) c.advice = "\"local.fabric\": \"nccl\" needs the NVIDIA driver; install it or use \"cma\"";
    return c;
  }
  using Init = int (*)(unsigned);
  using Version = int (*)(int*);
  using Count = int (*)(int*);
  using Get = int (*)(int*, int);
  using Name = int (*)(char*, int, int);
  auto init = symbol<Init>(lib, "cuInit");
  auto version = symbol<Version>(lib, "cuDriverGetVersion");
  auto count = symbol<Count>(lib, "cuDeviceGetCount");
  auto get = symbol<Get>(lib, "cuDeviceGet");
  auto name = symbol<Name>(lib, "cuDeviceGetName");
  int v = 0, n = 0;
  if (init == nullptr || version == nullptr || count == nullptr || init(0) != 0 || version(&v) != 0 ||
      count(&n) != 0) {
    c.outcome = needed ? Outcome::kFail : Outcome::kWarn;
    c.detail = "the CUDA driver is installed but cuInit failed (no GPU visible, or a driver/kernel module mismatch)";
    c.advice = "check `nvidia-smi` and CUDA_VISIBLE_DEVICES";
    dlclose(lib);
    return c;
  }
  std::ostringstream d;
  d << "driver API " << v / 1000 << "." << (v % 1000) / 10 << ", " << n << " device(s)";
  for (int i = 0; i < n && get != nullptr && name != nullptr; ++i) {
    int dev = 0;
    char buf[256] = {};
    if (get(&dev, i) == 0 && name(buf, sizeof buf, dev) == 0) d << (i == 0 ? ": " : ", ") << buf;
  }
  c.detail = d.str();
  if (n == 0) {
    c.outcome = needed ? Outcome::kFail : Outcome::kWarn;
    c.advice = "no GPU visible: check CUDA_VISIBLE_DEVICES";
  }
  dlclose(lib);
  return c;
}

Check check_nccl(bool needed) {
  Check c{"nccl"};
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    c.outcome = needed ? Outcome::kFail : Outcome::kSkip;
    c.detail = "libnccl.so.2 not found";
    if (needed) c.advice = "\"local.fabric\": \"nccl\" needs NCCL 2.x on the library path";
    return c;
  }
  using GetVersion = int (*)(int*);
  auto get_version = symbol<GetVersion>(lib, "ncclGetVersion");
  int v = 0;
  if (get_version == nullptr || get_version(&v) != 0) {
    c.outcome = needed ? Outcome::kFail : Outcome::kWarn;
    c.detail = "libnccl.so.2 found, ncclGetVersion failed";
  } else {
    // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9.
    c.detail = "NCCL " + std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
               std::to_string(v % 100);
  }
  dlclose(lib);
  return c;
}

refit::control::AuthRole role_of(const AgentConfig& config) {
  return config.receiver ? refit::control::AuthRole::kReceiver : refit::control::AuthRole::kSource;
}

// The coordinator's token file, or a role key file ("refit-<role>-key:..."),
// read as the agent reads it (transport/control/auth.h).
Check check_token_file(const AgentConfig& config) {
  Check c{"token"};
  const std::string& path = config.coordinator.token_file;
  auto credential = refit::control::read_credential_file(path);
  if (!credential.is_ok()) {
    c.outcome = Outcome::kFail;
    c.detail = credential.status().message();
    c.advice = "the file must be private and hold 16 to 4096 bytes: `(umask 077; head -c 32 /dev/urandom | base64 > " +
               path + ")`, or a role key from `refit-coordinator --print-role-key`";
    return c;
  }
  if (!credential->bound) {
    c.detail = "token file \"" + path + "\": the token itself (" + std::to_string(credential->token.size()) +
               " bytes, any role)";
    return c;
  }
  const bool receiver_key = *credential->bound == refit::control::AuthRole::kReceiver;
  c.detail = "token file \"" + path + "\": a " + (receiver_key ? "receiver" : "source") + " role key";
  if (config.coordinator.embedded) {
    c.outcome = Outcome::kFail;
    c.advice = "an embedded coordinator derives every role's key from the token: give it the token itself";
  } else if (!credential->key_for(role_of(config)).is_ok()) {
    c.outcome = Outcome::kFail;
    c.advice = std::string("this agent is a ") + (config.receiver ? "receiver" : "source") +
               ": give it that role's key (`refit-coordinator --print-role-key " +
               (config.receiver ? "receiver" : "source") + "`)";
  }
  return c;
}

Check check_coordinator(const AgentConfig& config) {
  Check c{"coordinator"};
  const std::string where = config.coordinator.host + ":" + std::to_string(config.coordinator.port);
  if (config.coordinator.embedded) {
    // The agent will listen there itself: the address must be free and local.
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(config.coordinator.host.c_str(), std::to_string(config.coordinator.port).c_str(), &hints, &res) != 0 ||
        res == nullptr) {
      c.outcome = Outcome::kFail;
      c.detail = "embedded coordinator: cannot resolve \"" + config.coordinator.host + "\"";
      c.advice = "set \"coordinator.address\" to an address of this host";
      return c;
    }
    const int fd = socket(res->ai_family, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    const int rc = fd < 0 ? -1 : bind(fd, res->ai_addr, res->ai_addrlen);
    const int err = errno;
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
    if (rc != 0) {
      c.outcome = Outcome::kFail;
      c.detail = "embedded coordinator: cannot listen on " + where + ": " + std::strerror(err);
      c.advice = err == EADDRINUSE ? "another process holds the port: pick another or stop it"
                                   : "use an address of this host in \"coordinator.address\"";
      return c;
    }
    c.detail = "embedded coordinator: " + where + " is free to listen on";
    return c;
  }
  auto credential = refit::control::read_credential_file(config.coordinator.token_file);
  if (!credential.is_ok()) {
    c.outcome = Outcome::kSkip;
    c.detail = "not tried: the token file cannot be used (see \"token\")";
    return c;
  }
  refit::control::ClientOptions options;
  options.timeout = std::min(config.coordinator.timeout, std::chrono::milliseconds(5000));
  options.role = role_of(config);
  const auto t0 = std::chrono::steady_clock::now();
  auto client = refit::control::Client::connect(config.coordinator.host, config.coordinator.port, *credential, options);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  if (!client.is_ok()) {
    c.outcome = Outcome::kFail;
    c.detail = where + ": " + client.status().message();
    const std::string& m = client.status().message();
    if (m.find("auth") != std::string::npos || m.find("challenge") != std::string::npos) {
      c.advice = "the coordinator refused this token: every member and the coordinator need the same token file";
    } else {
      c.advice = "start refit-coordinator there, or check \"coordinator.address\", routes and firewalls";
    }
    return c;
  }
  c.detail = where + ": reachable; authenticated as a " +
             (config.receiver ? "receiver" : "source") + " and the coordinator proved it holds the key (" +
             std::to_string(ms) + " ms)";
  return c;
}

void print(const Check& c) {
  std::printf("[%s] %-12s %s\n", label(c.outcome), c.name.c_str(), c.detail.c_str());
  if (!c.advice.empty()) std::printf("       %-12s -> %s\n", "", c.advice.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "refit-doctor: checks what this machine needs for a refit agent and says what to do about each problem.\n"
      "One line per check: ok, warn, FAIL or skip. Exit status: 0 when nothing the configuration needs is\n"
      "missing, 1 when a needed check failed, 2 on bad input."};
  std::string config_path, role = "auto", json_path;
  app.add_option("--config", config_path,
                 "an agent's JSON configuration (include/refit/refit.h); without it, a receiver's defaults "
                 "and no coordinator check");
  app.add_option("--role", role, "how to read --config: receiver, source, or auto (receiver, else source)")
      ->check(CLI::IsMember({"auto", "receiver", "source"}));
  app.add_option("--json", json_path, "also write the checks as JSON to this file");
  // UCX's own warnings would repeat what the checks say, out of line. UCX
  // reads its log level when the library loads, so the doctor sets it and
  // runs itself again (once: the variable is then set).
  if (std::getenv("UCX_LOG_LEVEL") == nullptr) {
    setenv("UCX_LOG_LEVEL", "error", 1);
    execv("/proc/self/exe", argv);  // on failure, go on with UCX's warnings
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitBadInput;
  }

  AgentConfig config;
  config.receiver = true;
  bool have_config = false;
  if (!config_path.empty()) {
    std::ifstream in(config_path);
    if (!in) {
      std::fprintf(stderr, "refit-doctor: cannot read --config \"%s\": %s\n", config_path.c_str(), std::strerror(errno));
      return kExitBadInput;
    }
    std::stringstream text;
    text << in.rdbuf();
    auto parsed = refit::Result<AgentConfig>(refit::Status::invalid("unparsed"));
    if (role != "source") parsed = refit::plugin::parse_agent_config(text.str(), /*receiver=*/true);
    if (role == "source" || (role == "auto" && !parsed.is_ok())) {
      auto as_source = refit::plugin::parse_agent_config(text.str(), /*receiver=*/false);
      if (as_source.is_ok() || role == "source") parsed = std::move(as_source);
    }
    if (!parsed.is_ok()) {
      std::fprintf(stderr, "refit-doctor: --config \"%s\": %s\n", config_path.c_str(),
                   parsed.status().message().c_str());
      return kExitBadInput;
    }
    config = *parsed;
    have_config = true;
  }

  const bool cma = config.receiver && config.local_fabric == "cma";
  const bool gpu = config.receiver && config.local_fabric == "nccl";
  std::printf("refit-doctor: %s\n",
              have_config ? ((config.receiver ? "receiver" : "source") + std::string(" config \"") + config_path + "\"").c_str()
                          : "no --config: a receiver's defaults (tcp, cma fabric), no coordinator");
  std::vector<Check> checks;
  auto run = [&](Check c) {
    print(c);
    checks.push_back(std::move(c));
  };
  run(check_cma(config, cma));
  run(check_memlock(config));
  run(check_thp());
  run(check_ucx_version());
  for (const auto& d : config.network.devices) {
    if (d != "all") run(check_device(d));
  }
  run(check_network_context(config));
  run(check_cuda(gpu));
  run(check_nccl(gpu));
  if (have_config) {
    run(check_token_file(config));
    run(check_coordinator(config));
  } else {
    run(Check{"coordinator", Outcome::kSkip, "no --config: nothing to connect to", ""});
  }

  int failed = 0, warned = 0;
  for (const auto& c : checks) {
    failed += c.outcome == Outcome::kFail;
    warned += c.outcome == Outcome::kWarn;
  }
  std::printf("refit-doctor: %d check(s), %d failed, %d warning(s)\n", static_cast<int>(checks.size()), failed, warned);
  if (!json_path.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& c : checks) {
      out.push_back({{"check", c.name}, {"outcome", json_label(c.outcome)}, {"detail", c.detail}, {"advice", c.advice}});
    }
    std::ofstream f(json_path);
    if (!(f << out.dump(2) << "\n")) {
      std::fprintf(stderr, "refit-doctor: cannot write --json \"%s\"\n", json_path.c_str());
      return kExitBadInput;
    }
  }
  return failed > 0 ? kExitFailed : 0;
}
