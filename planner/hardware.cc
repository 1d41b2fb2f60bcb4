#include "planner/hardware.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include <nlohmann/json.hpp>

#include "planner/json_util.h"

namespace refit {
namespace {

using nlohmann::json;

// The defaults and their sources. docs/simulator.md reproduces this table;
// keep the two in step. Published figures are quoted as what they are:
// typical values from the named benchmark, not measurements of this project.
const std::vector<HardwareKey> kKeys = {
    {"nic_gbit_per_gpu", "Gbit/s", 400,
     "line rate of one NIC per GPU: DGX H100 has eight ConnectX-7 400 Gbit/s NDR compute NICs, one per GPU; "
     "GB200 NVL72 compute trays have one 400 Gbit/s ConnectX-7 per GPU"},
    {"nic_achievable", "fraction", 0.9,
     "perftest ib_read_bw on 400 Gbit/s NDR links typically reports 360-390 Gbit/s for large messages"},
    {"latency_us", "us", 3,
     "round trip of one RDMA READ: perftest ib_read_lat reports a few microseconds through one switch level"},
    {"get_op_us", "us", 1,
     "posting and completing one RDMA READ through UCX (ucp_get_nbx, a completion callback): on the order of a "
     "microsecond whatever its size, a few million small READs per second per initiator"},
    {"nvlink_gbyte_per_gpu", "GB/s", 450,
     "NVLink 4 (H100 SXM): 900 GB/s per GPU both directions, 450 GB/s each way; NVLink 5 (GB200) is 900 GB/s "
     "each way"},
    {"nvlink_achievable", "fraction", 0.8,
     "nccl-tests point-to-point and all_gather bus bandwidth on NVSwitch systems reaches about 80% of the "
     "per-direction link rate"},
    {"local_op_us", "us", 5,
     "launching one fan-out send (an NCCL group of send/recv): a few microseconds. With fanout_rounds, a round "
     "pays it twice: its count exchange (a group and the wait for it) and its group of sends"},
    {"fanout_rounds", "bool", 1,
     "the nccl fabric's rounds (transport/fabric/nccl_fabric.cc): the ranks of a domain that pass slices to each "
     "other go in lockstep rounds; each round passes on, per peer, the ready sends (at most 256, the pack's share) "
     "as one NCCL group. false: one op per send, one after another per puller, as the cma and ucx fabrics send "
     "(refit-bench's --hardware files default to false)"},
    {"local_send_us", "us", 1,
     "not measured: one send or receive inside a round's NCCL group (a pack or an unpacked send), beside its "
     "bytes; NCCL runs a group's operations in one kernel, and most of the few microseconds nccl-tests reports "
     "for one sendrecv is the launch, charged as local_op_us"},
    {"fanout_pack_bytes", "bytes", 64.0 * (1 << 20),
     "the nccl fabric's default pack_bytes (transport/fabric/pack.h): the small sends of one round to one peer "
     "travel as one pack of at most pack_bytes / (domain GPUs - 1); 0 models the unpacked fan-out, one send per run"},
    {"fanout_pack_threshold", "bytes", 1.0 * (1 << 20),
     "the nccl fabric's default pack_threshold (transport/fabric/pack.h): sends of at least this go unpacked"},
    {"gpu_memory_gbyte_per_gpu", "GB/s", 3350,
     "datasheet HBM bandwidth: H100 SXM HBM3 3.35 TB/s; B200 (GB200) HBM3e 8 TB/s. The packed fan-out's gather "
     "and scatter kernels copy at it"},
    {"gpu_memory_achievable", "fraction", 0.8,
     "measured on one H200 (refit_gpu_kernel_bench, docs/measurements.md): the scatter kernel copies 16-byte aligned "
     "pieces of 64 KiB or more at 1,928 to 1,968 GB/s (three runs), 0.80 to 0.82 of the 4.8 TB/s datasheet rate counting each byte read "
     "and written (cudaMemcpy 0.87); a copy moves bytes at half of this rate"},
    {"h2d_gbyte_per_gpu", "GB/s", 50,
     "PCIe Gen5 x16 is 64 GB/s each way; CUDA bandwidthTest reaches about 50 GB/s from pinned memory, and "
     "refit_staging_bench's pinned copies 55.2 to 55.4 GB/s on one H200 machine (docs/measurements.md)"},
    {"d2h_gbyte_per_gpu", "GB/s", 50, "as h2d_gbyte_per_gpu, the other way"},
    {"gets_land_in_host", "bool", 0,
     "true where UCX cannot write GPU memory: GETs land in the receiver's pinned landing ring and are copied to "
     "the GPU (docs/refresh.md, the nccl fabric)"},
    {"source_host_mirror", "bool", 0,
     "true where sources serve a pinned host mirror of their GPU shards, filled by a device-to-host copy at "
     "publish (docs/refresh.md)"},
    {"convert_gbyte_per_gpu", "GB/s", 237,
     "measured on one H200 (refit_gpu_kernel_bench, docs/measurements.md): the CUDA block quantization call reads "
     "BF16 at 217 to 237 GB/s on a Kimi-K2 expert (7168 x 2048, its scratch allocation and wait included; three runs, "
     "the first's 237 is the default) and 359 to 362 GB/s on 1 GiB; it is not bound by memory, so an H100 should not differ much. GB/s of source bytes read; the staged "
     "box's copy to the GPU is charged at h2d_gbyte_per_gpu"},
    {"host_convert_gbyte", "GB/s", 2.1,
     "refit_convert_bench on the project's 2-core test machine, one thread: BF16 to F8_E4M3 in 128x128 blocks "
     "reads 2.03 to 2.16 GB/s (three runs, best of 5 each); its casts read 3.2 to 14.5 GB/s, so charging them this rate is conservative. "
     "Used for casts into GPU memory (done on the host), for receivers in host memory and for the sources' "
     "converted copies"},
    {"convert_on_host", "bool", 0,
     "true where the receivers' buffers are host memory (refit-bench on one machine): the CPU kernel converts from "
     "the staging area, nothing is copied to a GPU"},
    {"host_cores", "cores", 0,
     "0: every rank has a machine of its own. refit-bench runs every rank on one machine: its cores are shared, "
     "and a refresh takes at least the CPU time of its transfers (the *_cpu_ns keys, get_op_us per GET, the CPU "
     "kernel's conversions) over them; scripts/calibrate writes this machine's count"},
    {"get_cpu_ns", "ns/byte", 0,
     "CPU time, source and receiver together, per byte of a plain GET on the shared machine: refit-ucx-bench's "
     "cpu_ns_per_byte at 64 MiB over tcp (scripts/calibrate)"},
    {"gather_cpu_ns", "ns/byte", 0,
     "as get_cpu_ns, per byte of a run carried in a gather (the source copies it into its replies, the receiver "
     "scatters them): refit-ucx-bench --gathers, runs of 512 bytes (scripts/calibrate)"},
    {"local_cpu_ns", "ns/byte", 0,
     "CPU time per byte of a fan-out send on the shared machine (the cma fabric's process_vm_writev; broadcast: "
     "its copy out): one over refit-cma-bench's rate into huge pages (scripts/calibrate)"},
    {"window_bytes", "bytes", 64.0 * (1 << 20), "the receiver agent's default window_bytes (plugin/config.h)"},
    {"get_chunk_bytes", "bytes", 1.0 * (1 << 20), "the receiver agent's default chunk_bytes (plugin/config.h)"},
};

// Keys for which 0 means "off" rather than a missing figure.
constexpr double kMaxPackBytes = 1099511627776.0;  // 2^40
constexpr double kMaxWindowBytes = 1125899906842624.0;  // 2^50: far beyond any window, well inside an int64

bool may_be_zero(const char* key) {
  for (const char* k : {"fanout_pack_bytes", "host_cores", "get_cpu_ns", "gather_cpu_ns", "local_cpu_ns"})
    if (std::strcmp(key, k) == 0) return true;
  return false;
}

bool is_bool_key(const char* key) {
  return std::strcmp(key, "gets_land_in_host") == 0 || std::strcmp(key, "source_host_mirror") == 0 ||
         std::strcmp(key, "convert_on_host") == 0 || std::strcmp(key, "fanout_rounds") == 0;
}

// The field of `m` that `key` names; bools are handled apart.
double* field(HardwareModel& m, const std::string& key) {
  if (key == "nic_gbit_per_gpu") return &m.nic_gbit_per_gpu;
  if (key == "nic_achievable") return &m.nic_achievable;
  if (key == "latency_us") return &m.latency_us;
  if (key == "get_op_us") return &m.get_op_us;
  if (key == "nvlink_gbyte_per_gpu") return &m.nvlink_gbyte_per_gpu;
  if (key == "nvlink_achievable") return &m.nvlink_achievable;
  if (key == "local_op_us") return &m.local_op_us;
  if (key == "local_send_us") return &m.local_send_us;
  if (key == "fanout_pack_bytes") return &m.fanout_pack_bytes;
  if (key == "fanout_pack_threshold") return &m.fanout_pack_threshold;
  if (key == "gpu_memory_gbyte_per_gpu") return &m.gpu_memory_gbyte_per_gpu;
  if (key == "gpu_memory_achievable") return &m.gpu_memory_achievable;
  if (key == "h2d_gbyte_per_gpu") return &m.h2d_gbyte_per_gpu;
  if (key == "d2h_gbyte_per_gpu") return &m.d2h_gbyte_per_gpu;
  if (key == "convert_gbyte_per_gpu") return &m.convert_gbyte_per_gpu;
  if (key == "host_convert_gbyte") return &m.host_convert_gbyte;
  if (key == "host_cores") return &m.host_cores;
  if (key == "get_cpu_ns") return &m.get_cpu_ns;
  if (key == "gather_cpu_ns") return &m.gather_cpu_ns;
  if (key == "local_cpu_ns") return &m.local_cpu_ns;
  if (key == "window_bytes") return &m.window_bytes;
  if (key == "get_chunk_bytes") return &m.get_chunk_bytes;
  return nullptr;
}

bool* flag(HardwareModel& m, const std::string& key) {
  if (key == "gets_land_in_host") return &m.gets_land_in_host;
  if (key == "source_host_mirror") return &m.source_host_mirror;
  if (key == "convert_on_host") return &m.convert_on_host;
  if (key == "fanout_rounds") return &m.fanout_rounds;
  return nullptr;
}

}  // namespace

const std::vector<HardwareKey>& hardware_keys() { return kKeys; }

std::optional<double> hardware_value(const HardwareModel& model, const std::string& key) {
  HardwareModel m = model;  // field() and flag() hand out pointers into a model
  if (const double* f = field(m, key)) return *f;
  if (const bool* b = flag(m, key)) return *b ? 1.0 : 0.0;
  return std::nullopt;
}

bool is_boolean_hardware_key(const std::string& key) { return is_bool_key(key.c_str()); }

HardwareModel default_hardware() {
  HardwareModel m;
  for (const HardwareKey& k : kKeys) {
    if (double* f = field(m, k.key)) *f = k.default_value;
    if (bool* b = flag(m, k.key)) *b = k.default_value != 0;
  }
  return m;
}

Status apply_hardware(const json& obj, const std::string& origin, const std::string& path, bool require_link_rates,
                      HardwareModel* model, std::vector<std::string>* given) {
  auto name = [&](const std::string& k) { return path.empty() ? k : path + "." + k; };
  if (!obj.is_object())
    return Status::invalid(origin + ": \"" + path + "\" must be an object, got " + json_util::show(obj));
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool known = false;
    for (const HardwareKey& k : kKeys) known |= it.key() == k.key;
    if (known) continue;
    std::string list;
    for (const HardwareKey& k : kKeys) list += std::string(list.empty() ? "" : ", ") + k.key;
    return Status::invalid(origin + ": unknown key \"" + name(it.key()) + "\" (known: " + list + ")");
  }
  if (require_link_rates) {
    for (const char* k : {"nic_gbit_per_gpu", "nvlink_gbyte_per_gpu"})
      if (!obj.contains(k)) return Status::invalid(origin + ": missing key \"" + name(k) + "\"");
  }
  for (const HardwareKey& k : kKeys) {
    auto it = obj.find(k.key);
    if (it == obj.end()) continue;
    if (is_bool_key(k.key)) {
      if (!it->is_boolean())
        return Status::invalid(origin + ": \"" + name(k.key) + "\" must be true or false, got " +
                               json_util::show(*it));
      *flag(*model, k.key) = it->get<bool>();
    } else {
      const bool zero_ok = may_be_zero(k.key) && it->is_number() && it->get<double>() == 0;
      if (!zero_ok && (!it->is_number() || !(it->get<double>() > 0) || !std::isfinite(it->get<double>())))
        return Status::invalid(origin + ": \"" + name(k.key) + "\" must be a positive number" +
                               (may_be_zero(k.key) ? " or 0" : "") + ", got " + json_util::show(*it));
      *field(*model, k.key) = it->get<double>();
    }
    if (given) given->push_back(k.key);
  }
  return check_hardware(*model, origin, path);
}

Status check_hardware(const HardwareModel& model, const std::string& origin, const std::string& path) {
  HardwareModel m = model;  // field() hands out pointers into a model
  auto name = [&](const char* k) { return "\"" + (path.empty() ? std::string(k) : path + "." + k) + "\""; };
  auto bad = [&](const char* k, const std::string& why) { return Status::invalid(origin + ": " + name(k) + " " + why); };
  for (const HardwareKey& k : kKeys) {
    if (is_bool_key(k.key)) continue;
    const double v = *field(m, k.key);
    if (may_be_zero(k.key) && v == 0) continue;
    if (!(v > 0) || !std::isfinite(v)) return bad(k.key, "must be a positive number, got " + std::to_string(v));
  }
  if (m.nic_achievable > 1) return bad("nic_achievable", "is a fraction of the line rate: at most 1");
  if (m.nvlink_achievable > 1) return bad("nvlink_achievable", "is a fraction of the link rate: at most 1");
  if (m.gpu_memory_achievable > 1) return bad("gpu_memory_achievable", "is a fraction of the HBM rate: at most 1");
  // Byte counts the simulator casts to integers: whole numbers, at most
  // `most` (`range` says so in the message).
  auto whole_bytes = [&](std::initializer_list<const char*> keys, double most, const char* range) -> Status {
    for (const char* k : keys) {
      const double v = *field(m, k);
      if (v != std::floor(v) || v > most) {
        char shown[32];
        std::snprintf(shown, sizeof shown, "%.17g", v);
        return bad(k, std::string("must be a whole number of bytes, ") + range + ", got " + shown);
      }
    }
    return Status::ok();
  };
  // At most 2^40, as the fabric's "pack_bytes" and "pack_threshold" (plugin/config.cc).
  REFIT_RETURN_IF_ERROR(
      whole_bytes({"fanout_pack_bytes", "fanout_pack_threshold"}, kMaxPackBytes, "at most 1099511627776 (2^40)"));
  // The GET chunk and the window are cut into whole bytes: a fraction would
  // become a chunk of 0 bytes.
  REFIT_RETURN_IF_ERROR(
      whole_bytes({"get_chunk_bytes", "window_bytes"}, kMaxWindowBytes, "at least 1 and at most 2^50"));
  // A pack area below 64 KiB (other than 0) is refused by the fabric too (transport/fabric/pack.h).
  if (m.fanout_pack_bytes != 0 && m.fanout_pack_bytes < 65536)
    return bad("fanout_pack_bytes", "must be 0 (packing off) or at least 65536, got " + std::to_string(m.fanout_pack_bytes));
  // 100 TB/s per GPU is far beyond any link of today: a unit mistake.
  constexpr double kMaxGbyte = 100'000;
  if (m.nic_gbit_per_gpu / 8 > kMaxGbyte) return bad("nic_gbit_per_gpu", "is above 100 TB/s: check the unit (Gbit/s)");
  for (const char* k : {"nvlink_gbyte_per_gpu", "h2d_gbyte_per_gpu", "d2h_gbyte_per_gpu", "convert_gbyte_per_gpu",
                        "host_convert_gbyte", "gpu_memory_gbyte_per_gpu"})
    if (*field(m, k) > kMaxGbyte) return bad(k, "is above 100 TB/s: check the unit (GB/s)");
  if (m.nic_gbit_per_gpu / 8 > 100 * m.nvlink_gbyte_per_gpu)
    return bad("nic_gbit_per_gpu", "(" + std::to_string(m.nic_gbit_per_gpu) +
                                       " Gbit/s) is more than 100x the NVLink bandwidth (" +
                                       std::to_string(m.nvlink_gbyte_per_gpu) +
                                       " GB/s): check the units (Gbit/s and GB/s)");
  for (const char* k : {"latency_us", "get_op_us", "local_op_us", "local_send_us"})
    if (*field(m, k) > 1e6) return bad(k, "is above one second: check the unit (us)");
  if (m.host_cores != std::floor(m.host_cores) || m.host_cores > 65536)
    return bad("host_cores", "must be a whole number of cores, at most 65536, got " + std::to_string(m.host_cores));
  // A byte that costs a millisecond of CPU: a unit mistake (ns per byte).
  for (const char* k : {"get_cpu_ns", "gather_cpu_ns", "local_cpu_ns"})
    if (*field(m, k) > 1e6) return bad(k, "is above a millisecond per byte: check the unit (ns per byte)");
  if (m.get_chunk_bytes > m.window_bytes)
    return bad("get_chunk_bytes", "must not exceed \"window_bytes\" (" + std::to_string(m.window_bytes) + ")");
  return Status::ok();
}

}  // namespace refit
