#pragma once
// The hardware model of the refresh simulator (docs/simulator.md): per-GPU
// NIC and NVLink bandwidth, the fractions of them that benchmarks reach, the
// cost of one GET, host copies. Every figure has a default with its source
// (hardware.cc, the one place they are written down), and a scenario's
// `hardware` object overrides any of them by key.
//
// Pure data and checks: no I/O. Thread safety: plain values.

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "planner/status.h"

namespace refit {

struct HardwareModel {
  // Network: one NIC per GPU on both sides.
  double nic_gbit_per_gpu = 0;     // line rate, Gbit/s
  double nic_achievable = 0;       // fraction of the line rate an RDMA READ stream reaches
  double latency_us = 0;           // round trip of one RDMA READ, not occupying the NIC
  double get_op_us = 0;            // posting and completing one GET, whatever its size
  // NVLink: the fan-out inside a receiving domain.
  double nvlink_gbyte_per_gpu = 0;  // per GPU and direction, GB/s
  double nvlink_achievable = 0;     // fraction that point-to-point sends reach
  double local_op_us = 0;           // launching one fan-out send; with rounds, one NCCL group
  // The nccl fabric's rounds (docs/simulator.md, "The fan-out in rounds"):
  // a domain's ranks pass on their ready sends in lockstep rounds, a count
  // exchange and one group of sends each. false: every send on its own,
  // one after another per puller (the cma and ucx fabrics).
  bool fanout_rounds = false;
  double local_send_us = 0;  // one send or receive inside a round's group, beside its bytes
  // The packed fan-out (docs/refresh.md, "Packed fan-out"): the nccl
  // fabric's pack area per rank (0: packing off) and the GPU memory
  // bandwidth its gather and scatter kernels copy at.
  double fanout_pack_bytes = 0;
  double fanout_pack_threshold = 0;     // sends of at least this go unpacked
  double gpu_memory_gbyte_per_gpu = 0;  // HBM, GB/s
  double gpu_memory_achievable = 0;     // fraction a device-to-device copy kernel reaches
  // Host copies, where they happen.
  double h2d_gbyte_per_gpu = 0;  // landed GET bytes to the GPU (gets_land_in_host)
  double d2h_gbyte_per_gpu = 0;  // the source's publish copy (source_host_mirror)
  bool gets_land_in_host = false;   // UCX without GPU memory support: GETs land in a host ring
  bool source_host_mirror = false;  // sources serve a host mirror filled at publish
  // Conversion on the way (docs/conversion.md): GB/s of source bytes read.
  double convert_gbyte_per_gpu = 0;  // the CUDA kernel: F8_E4M3 block quantization into GPU memory
  double host_convert_gbyte = 0;     // the CPU kernel, one thread: casts, host receivers, sources' copies
  bool convert_on_host = false;      // receivers' buffers are host memory: the CPU kernel, no copy
  // One machine that every rank shares (refit-bench: all ranks on this
  // host, their "NICs" one loopback device, their "NVLink" its memory):
  // the refresh takes at least the CPU time of all its transfers over
  // `host_cores`. 0: every rank has hardware of its own (a cluster).
  double host_cores = 0;
  double get_cpu_ns = 0;     // CPU (both ends) per byte of a plain GET
  double gather_cpu_ns = 0;  // CPU (both ends) per byte of a run carried in a gather
  double local_cpu_ns = 0;   // CPU per byte of a fan-out send (broadcast: of its copy out)
  // The receiver agent's GET window (plugin/config.h defaults).
  double window_bytes = 0;     // bytes in flight per receiver
  double get_chunk_bytes = 0;  // largest single GET

  double nic_bytes_per_s() const { return nic_gbit_per_gpu * 1e9 / 8 * nic_achievable; }
  double nvlink_bytes_per_s() const { return nvlink_gbyte_per_gpu * 1e9 * nvlink_achievable; }
  // A copy within GPU memory reads and writes each byte: bytes copied per second.
  double gpu_copy_bytes_per_s() const { return gpu_memory_gbyte_per_gpu * 1e9 * gpu_memory_achievable / 2; }
  double h2d_bytes_per_s() const { return h2d_gbyte_per_gpu * 1e9; }
  double d2h_bytes_per_s() const { return d2h_gbyte_per_gpu * 1e9; }
  double convert_bytes_per_s() const { return convert_gbyte_per_gpu * 1e9; }
  double host_convert_bytes_per_s() const { return host_convert_gbyte * 1e9; }
};

// One documented parameter: its key, unit, default and where the default
// comes from.
struct HardwareKey {
  const char* key;
  const char* unit;
  double default_value;  // booleans: 0 or 1
  const char* source;
};

// Every key a scenario's `hardware` may hold, in documentation order.
const std::vector<HardwareKey>& hardware_keys();

// The value of key `key` in `model` (hardware_keys()): a number, or 0 or 1
// for a boolean key; nullopt for a key that is not one.
std::optional<double> hardware_value(const HardwareModel& model, const std::string& key);
bool is_boolean_hardware_key(const std::string& key);

// The defaults: an H100 NDR node (400 Gbit/s per GPU, NVLink 4).
HardwareModel default_hardware();

// Applies the keys of `obj` (a scenario's "hardware" object) to `model`.
// Every key must be known and of its type; numbers must be positive and
// finite. `path` prefixes key names in messages ("hardware"), `origin`
// starts them (the file). With `require_link_rates`, nic_gbit_per_gpu and
// nvlink_gbyte_per_gpu must be present (a scenario's hardware object always
// gives both). `*given` receives the keys that were present.
Status apply_hardware(const nlohmann::json& obj, const std::string& origin, const std::string& path,
                      bool require_link_rates, HardwareModel* model, std::vector<std::string>* given = nullptr);

// Refuses figures no machine has, naming the key: a fraction above 1, a NIC
// more than 100x faster than NVLink, bandwidths above 100 TB/s, latencies or
// per-operation costs above a second, a GET chunk larger than the window.
Status check_hardware(const HardwareModel& model, const std::string& origin, const std::string& path);

}  // namespace refit
