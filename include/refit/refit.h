/*
 * refit: the C ABI of librefit.so.
 *
 * Plain C: opaque handles, a status enum, a thread-local last-error string,
 * no C++ types and no exceptions across it. Only symbols that start with
 * refit_ are exported. Nothing in the library calls abort() or exit(); every
 * failure is a status and a message from refit_last_error().
 *
 * Two kinds of agent:
 *  - A source lives in a trainer process. It registers the trainer's shards
 *    (refit_source_add_tensor), then publishes versions: after the trainer
 *    has written version v into its shards it calls refit_source_publish(v).
 *    Version v is available to receivers once every source rank of the
 *    group has published it. The shards must stay unchanged until
 *    refit_source_wait_drained(v) returns REFIT_OK (see "Versions, leases
 *    and commits" below).
 *  - A receiver lives in an inference process. It registers the buffers it
 *    wants filled (refit_receiver_add_buffer), then refreshes to a version:
 *    it pulls exactly its slices from the sources over the network, once per
 *    domain, and the slices are passed on to the other ranks of its domain
 *    over the local fabric while the next ones arrive.
 *
 * Configuration is one JSON document per agent. Unknown keys and wrong types
 * are errors that name the key. Keys (defaults in brackets):
 *
 *   Both agents:
 *     "rank"         integer >= 0, required: this rank on its side
 *     "domain"       integer >= 0 [0]: ranks of one domain share a fast local
 *                    fabric (one NVLink domain; one host in the tests)
 *     "coordinator"  object, required:
 *        "address"     "HOST:PORT" of the coordinator, required
 *        "token_file"  file holding the secret, required; mode 600 (a file group or
 *                      others may access is refused, as ssh refuses such keys).
 *                      Either the coordinator's token (16 to 4096 bytes) or this
 *                      role's key only ("refit-source-key:..." or
 *                      "refit-receiver-key:...", from refit-coordinator
 *                      --print-role-key): a receiver that holds the receiver key
 *                      cannot register a source. The agent authenticates as its
 *                      role and checks that the coordinator holds that role's
 *                      key too; every frame after is sealed (docs/security.md).
 *                      A broken connection is made again, and the member
 *                      registered again, by the next call within its deadline;
 *                      once the coordinator has seen the old connection close,
 *                      the same registration takes the member over at once,
 *                      its lease and plan kept (else it waits for the old
 *                      member's heartbeat timeout). A new process registering
 *                      that rank replaces the old member as soon as its
 *                      connection closed.
 *        "embedded"    bool [false]: start the coordinator inside this process,
 *                      listening on "address", before connecting to it (needs
 *                      the token in "token_file", not a role key)
 *        "timeout_ms"  integer [10000]: deadline of each coordinator call
 *        "metrics"     object, with "embedded" only: the embedded coordinator
 *                      serves Prometheus metrics (GET /metrics, read-only) of
 *                      the whole job, every receiver's refreshes included
 *                      (docs/operations.md), like refit-coordinator --metrics:
 *           "address"    "HOST:PORT", required; port 0: any free port. Taken
 *                        or malformed: create fails naming it
 *           "token_file" file holding a bearer token scrapes must send
 *                        ("Authorization: Bearer TOKEN") [none: no token]
 *        "relayout_below_bytes" integer, with "embedded" only [0: never]: the
 *                      embedded coordinator's plans pull a unit whose network
 *                      runs would average under this many bytes (a
 *                      column-major receiver of a row-major source) row-major
 *                      into the puller's staging area and copy it into its
 *                      layout there (docs/refresh.md, "Column-major
 *                      receivers"; into GPU memory by a CUDA kernel)
 *        "relayout_staging_bytes" integer, with "embedded" only [1073741824]:
 *                      the most staging bytes one puller's relayouts take
 *     "network"      object: the UCX context the data crosses the network on
 *        "transports"  list of strings ["tcp"]: "tcp", "shm", or UCX names (rc, dc, ...)
 *        "devices"     list of strings: e.g. ["lo"] or ["mlx5_0:1"]; workers listen
 *                      only there. Default: with tcp, the interface that reaches
 *                      the coordinator's address (a wildcard address is refused:
 *                      name the devices); with rc, dc or ud, all of UCX's
 *     "heartbeat_ms" integer [1000]: how often the agent tells the coordinator it lives
 *     "log_level"    "error" | "warn" | "info" | "debug" ["warn"]; REFIT_LOG_LEVEL overrides.
 *                    Lines go to stderr, or to refit_set_log_callback()'s callback
 *     "log_format"   "text" | "json" ["text"]: every line names the agent's role,
 *                    its rank and the version its work concerns. text:
 *                    refit[receiver 3] [v7] warn: ... ("[v-]" before it has
 *                    a version; the callback's line has no level word). json:
 *                    one object per line, {"time", "level", "role", "rank",
 *                    "version" (null before it has one), "message"}, the same
 *                    to stderr and to the callback (docs/operations.md)
 *     "verify"       bool [false]: end-to-end verification. A source hashes (XXH3-64)
 *                    each box it serves when it publishes; a receiver checks
 *                    every box it got against its source's hash once the
 *                    refresh has landed, and fails the refresh (REFIT_VERIFY_FAILED,
 *                    naming the tensor and box; not retried) on a difference.
 *                    Boxes without a hash (a source without "verify", or a
 *                    receiver layout registered after the publish) are counted
 *                    in the report and logged, not failed. A box converted on
 *                    the way is checked as converted; one that cuts a
 *                    quantization block, and block scales, are unverified
 *                    (docs/conversion.md). Host buffers only (not with
 *                    "local": {"fabric": "nccl"})
 *     "test"         object, for tests only (never in production; docs/receiver.md):
 *        "refuse_threads_after" integer [none]: the agent starts that many
 *                               threads (its coordinator link's, its
 *                               transports' and an embedded coordinator's
 *                               included), then is refused every later one,
 *                               as the system refuses one at its limit
 *        "force_landing_ring"   bool [false], receivers only: host buffers
 *                               take the landing ring too
 *
 *   A thread the system refuses is never fatal: the call that needed it
 *   (create, join, publish, refresh) fails with REFIT_IO_ERROR naming the
 *   thread, and the agent may be destroyed or tried again.
 *
 *   Source only:
 *     "snapshot"     bool [false]: publish copies the shards into buffers of the
 *                    library's own, and the trainer may write its shards again as
 *                    soon as publish returns (instead of after wait_drained)
 *     "gather_reply_bytes" integer [268435456]: the most memory the source holds
 *                    for the replies of the gathers it serves, 1 MiB to 1 TiB; a
 *                    gather that would pass it waits (its receiver asks again),
 *                    and one larger than it is refused, naming both sizes;
 *                    the reply buffers are kept for the next gathers (never
 *                    more than this) while the source lives
 *                    (docs/refresh.md, "Gathers")
 *     "quantize"     "receiver" | "source" ["receiver"]: where a tensor that
 *                    the receivers hold in another dtype (F8_E4M3 with block
 *                    scales, or a cast) is converted. "source": at each
 *                    publish this source converts the whole blocks of its
 *                    segments of such tensors into copies of its own, which
 *                    the network then carries (FP8 plus scales instead of
 *                    BF16); what cuts a block, or does not fit, is converted
 *                    by the receiver as by default (docs/conversion.md,
 *                    "At the source"). A publish first waits, as in
 *                    snapshot mode, until no receiver reads the previous
 *                    version (up to coordinator.timeout_ms)
 *     "quantize_source_bytes" integer [1073741824]: with "quantize": "source",
 *                    the most host memory the copies and their scales hold,
 *                    0 to 1 TiB; a copy past it is left out (logged)
 *
 *   Receiver only:
 *     "instance"     integer >= 0 [0]: the inference replica this rank belongs to
 *     "instance_ranks" integer >= 1 [not declared]: how many ranks the instance
 *                    has. Every rank of the instance must declare the same
 *                    number. A version is refreshed and committed for the
 *                    instance only while all of them are members: a refresh
 *                    waits (until its deadline) for a rank that has not joined,
 *                    and a rank missing aborts the version for this instance
 *                    only. Not declared: the ranks registered at the time are
 *                    the instance
 *     "weight_block_size" [rows, cols] [[128, 128]]: the F8_E4M3 quantization
 *                    block of the server's model (its quantization_config's
 *                    weight_block_size), used when a buffer holds a tensor as
 *                    F8_E4M3 that the sources serve as BF16 or F32
 *                    (refit_receiver_add_buffer()). Every receiver of the
 *                    membership must declare the same
 *     "trace"        file path [none]: a Chrome trace (JSON array of trace
 *                    events; Perfetto and chrome://tracing open it) of every
 *                    refresh, written when each refresh and commit ends: one
 *                    track per rank, spans for the lease, the plan fetch, the
 *                    GET batch, the fan-out sends, the landing copies,
 *                    verification, the barrier and the commit, and a counter
 *                    of GET bytes in flight (docs/operations.md). A path that
 *                    cannot be written fails create; a later write error is
 *                    logged and ends the trace, never a refresh
 *     "mode"         "direct" | "staged" ["direct"]: direct refreshes write the
 *                    server's buffers (pause for the whole refresh); staged ones
 *                    write staging copies while the server goes on, and
 *                    refit_receiver_commit() copies them in (the only pause)
 *     "local"        object: the local fabric, which passes slices on inside the domain
 *        "fabric"      "cma" | "ucx" | "nccl" ["cma"]: host memory by cross-memory
 *                      attach (process_vm_writev) or UCX PUTs ("cma" falls back to
 *                      "ucx" where the kernel forbids it); GPU memory by NCCL (a
 *                      build with CUDA and NCCL). With "nccl" the buffers must be
 *                      GPU memory: where UCX cannot write device memory (no CUDA
 *                      support in the UCX build) GETs land in a ring of pinned
 *                      host slots ("landing_bytes") and are copied on to the GPU
 *                      chunk by chunk, overlapped with the next GETs; staged mode
 *                      keeps its staging copy on the GPU
 *        "device"      integer [the current CUDA device]: "nccl" only
 *        "transports"  list of strings ["shm"]: the UCX fabric's transports
 *     "window_bytes" integer [67108864]: bytes of GETs in flight at once
 *     "chunk_bytes"  integer [1048576]: the transfer chunk, the largest single
 *                    GET or PUT (a gather is one request of up to "gather_bytes")
 *     "gather_below_bytes" integer [1048576]: network runs smaller than this
 *                    travel in gathers, many runs of one source in one request
 *                    (docs/refresh.md, "Gathers"); 0 turns gathers off. At most
 *                    64 MiB
 *     "gather_bytes" integer [16777216, or "window_bytes" if smaller]: bytes of
 *                    one gather, one request, 1 to 64 MiB and at most
 *                    "window_bytes"; a run
 *                    below "gather_below_bytes" but above this travels alone
 *                    and the report counts it ("gathers": {"unpacked"})
 *     "gather_entries" integer [8192]: runs of one gather, 2 to 65536
 *     "max_plan_runs" integer [16777216]: the most runs this rank's plan part
 *                    may hold once its run groups are expanded, 1 to 2^26;
 *                    a larger part is refused naming this key. Each run
 *                    takes about 270 bytes of host memory once the part is
 *                    parsed (more with buffer names of hundreds of bytes),
 *                    more while it is compiled (a Qwen3-235B receiver at
 *                    TP 8 in a 64-GPU domain has 6.4 million)
 *     "landing_bytes" integer [67108864]: pinned host
 *                    memory of the landing ring (GPU buffers that UCX cannot
 *                    write), in slots of "chunk_bytes" but at most 4 MiB each:
 *                    at least two slots, at
 *                    most 1 TiB. Allocated at the first such buffer; more
 *                    slots than the window lets GETs go on while earlier
 *                    chunks are copied to the GPU
 *     "recipe"       object, for buffers added by recipe name:
 *        "model"       path of a model manifest (safetensors header JSON), required;
 *                      its Hugging Face config NAME.config.json must lie beside
 *                      NAME.json (heads and head_dim come from it)
 *        "framework"   "vllm" ["vllm"]
 *        "tp", "pp", "dp"       integers [1]: the inference side's parallelism
 *        "expert_parallel"      bool [false]
 *        "gpus_per_domain"      integer [tp*pp*dp]
 *
 * Versions, leases and commits (what never tears):
 *  - A receiver reads a version from the sources under a lease, which the
 *    library renews while the refresh runs, however long it takes. If the
 *    lease is lost anyway (the receiver stalled past the coordinator's lease
 *    timeout, or it was declared dead) the refresh fails with
 *    REFIT_IO_ERROR; it never returns REFIT_OK with what it read. A release
 *    that fails fails the refresh too.
 *  - Once refit_source_wait_drained(v) has returned REFIT_OK to any source
 *    (and so once a snapshot or mirror publish has reused the memory of v),
 *    no lease on v or an older version is granted again: the sources may be
 *    overwriting it. A refresh to REFIT_LATEST then waits for a newer
 *    version (REFIT_TIMEOUT if none is published before its deadline); a
 *    refresh to v itself (or older) fails with REFIT_NOT_FOUND, "version v
 *    was drained".
 *  - Staged mode: commit is final. Once the coordinator has decided commit
 *    for (instance, v), every rank of the instance commits v, and no rank is
 *    ever told abort for it. A rank whose deadline passes after it reported
 *    "staged" first reads every notice already sent to it, then withdraws:
 *    the coordinator answers in order, so its answer is the decision. If the
 *    instance had committed v, refit_receiver_refresh() returns REFIT_OK
 *    (one round trip past timeout_ms) and the rank commits v like the
 *    others; otherwise the withdrawal aborts v for the whole instance and
 *    every rank keeps its old version (REFIT_TIMEOUT here, REFIT_ABORTED on
 *    the others). Either way every rank of the instance ends on the same
 *    version. The one exception is a rank that cannot reach the coordinator
 *    at all at its deadline: it keeps its old version and its error says the
 *    instance may have committed without it.
 *
 * Descriptions of tensors and buffers are JSON too (see each function).
 * dtype names are the safetensors ones: BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8
 * U8 I16 I32 I64 BOOL.
 *
 * Threads: a handle may be used by one thread at a time ("the thread that
 * owns the handle" below; it may change between calls); different handles
 * are independent. refit_last_error() is per thread. An agent runs threads
 * of its own (progress, heartbeat); a process that fork()s while agents
 * exist should exec() in the child before calling refit again (UCX's memory
 * hooks hold a lock that a fork can copy while taken). Each function says
 * what it may block on; a call that talks to the coordinator is bounded by
 * "coordinator.timeout_ms", and a call that takes timeout_ms by that too.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define REFIT_EXPORT __attribute__((visibility("default")))
#else
#define REFIT_EXPORT
#endif

/* The version of the function table refit_get_api() returns. */
#define REFIT_ABI_VERSION 1u

/* refit_receiver_refresh*(): the newest version every source has published. */
#define REFIT_LATEST ((int64_t)-1)

/*
 * timeout_ms of every call that takes one: milliseconds from the call. Any
 * value >= 0 works; 0 gives up at once (refit_receiver_refresh_wait(): a
 * poll). A negative value is taken as 0. Values of a century
 * (3155760000000 ms) or more saturate to no deadline: the call waits as
 * long as it takes. REFIT_NO_DEADLINE is the value to pass for that.
 */
#define REFIT_NO_DEADLINE INT64_MAX

typedef enum refit_status {
  REFIT_OK = 0,
  REFIT_INVALID_ARGUMENT = 1, /* bad config, description, buffer or call order */
  REFIT_NOT_FOUND = 2,        /* a named thing (file, tensor, version) does not exist */
  REFIT_IO_ERROR = 3,         /* the network or a file failed */
  REFIT_TIMEOUT = 4,          /* a deadline passed */
  REFIT_UNSUPPORTED = 5,      /* valid, but not possible with this build */
  REFIT_INTERNAL = 6,         /* a bug in refit */
  REFIT_IN_PROGRESS = 7,      /* poll/wait: the refresh is still running */
  /* Refresh failures a server may act on differently (appended: the ABI
   * version stays 1). Each leaves the buffers as REFIT_IO_ERROR would. */
  REFIT_PEER_LOST = 8,        /* a source or a receiver of the domain died, left or failed its part, and
                                 the retries until the deadline did not get past it; or every source of
                                 a tensor this rank needs is gone (not retried; the message names it) */
  REFIT_ABORTED = 9,          /* staged: the instance aborted the version (a rank of it failed) */
  REFIT_VERIFY_FAILED = 10    /* "verify": the bytes that arrived are not the ones published (not retried) */
} refit_status_t;

typedef struct refit_source refit_source_t;
typedef struct refit_receiver refit_receiver_t;

/**
 * The library's version.
 *
 * @return "MAJOR.MINOR.PATCH": static, never NULL.
 * @note Any thread; never blocks.
 */
REFIT_EXPORT const char* refit_version(void);

/**
 * Why the last call on this thread that returned an error failed.
 *
 * @return A message that names the problem (the key, tensor, rank or peer),
 *         "" when there was none. Owned by the library; valid until this
 *         thread's next refit call.
 * @note Per thread; never blocks.
 */
REFIT_EXPORT const char* refit_last_error(void);

/**
 * The name of a status.
 *
 * @return A static string ("REFIT_OK", ...); "unknown" for other values.
 * @note Any thread; never blocks.
 */
REFIT_EXPORT const char* refit_status_name(refit_status_t status);

/* ---- Log ------------------------------------------------------------------ */

typedef enum refit_log_level {
  REFIT_LOG_ERROR = 0,
  REFIT_LOG_WARN = 1,
  REFIT_LOG_INFO = 2,
  REFIT_LOG_DEBUG = 3
} refit_log_level_t;

/**
 * A log callback: one line of refit's log, at `level`. `line` names the
 * agent and the version it concerns ("refit[receiver 0] [v3] refresh to 3,
 * attempt 1 failed, retrying: ..."), has no level word and no newline, and
 * is valid only during the call. With "log_format": "json" it is the JSON
 * object the agent would print ("log_format" above).
 * `user` is the pointer given to refit_set_log_callback().
 */
typedef void (*refit_log_fn)(refit_log_level_t level, const char* line, void* user);

/**
 * Routes the log lines of every agent of the process (and of a coordinator
 * an agent embeds) to `fn`, instead of stderr; NULL restores stderr. Only
 * lines at or above an agent's "log_level" (or REFIT_LOG_LEVEL) are logged.
 *
 * @param [in] fn    The callback, or NULL.
 * @param [in] user  Passed to every call of `fn`; may be NULL.
 *
 * @note `fn` is called on refit's own threads (progress, heartbeat, the
 *       coordinator's) and on threads that call refit, one call at a time
 *       (never two at once), while refit holds a lock: it must return
 *       promptly, must not throw, and must not call any refit_* function
 *       (that may deadlock). When this returns, no call to the previous
 *       callback is running or will start, so its `user` may be freed.
 *       Any thread; may block on a log line being delivered.
 */
REFIT_EXPORT void refit_set_log_callback(refit_log_fn fn, void* user);

/* ---- Source (trainer side) ---------------------------------------------- */

/**
 * Creates a source from its JSON config and connects to the coordinator
 * (starting it first with "embedded"). Starts the agent's threads.
 *
 * @param [in]  config_json  The config (the keys above), NUL-terminated.
 * @param [out] out          The new source; NULL on failure.
 *
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT for a NULL argument or a bad
 *         config (the message names the key) or a token file others may
 *         read; REFIT_IO_ERROR or REFIT_TIMEOUT for a token file that cannot
 *         be read, or a coordinator that cannot be reached or refuses the
 *         credentials (the message names the file or the address).
 * @note Any thread. Blocks for the connection and its handshake, at most
 *       "coordinator.timeout_ms".
 */
REFIT_EXPORT refit_status_t refit_source_create(const char* config_json, refit_source_t** out);

/**
 * Registers a tensor's shard held by this rank in [data, data + bytes), which
 * must stay valid until refit_source_destroy(). Either a DTensor spec:
 *
 *   {"name": "w", "dtype": "BF16", "shape": [4096, 4096],
 *    "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}}
 *
 * where the buffer holds this rank's local shard, row-major and contiguous,
 * and `bytes` must equal its size; or explicit segments:
 *
 *   {"name": "q", "dtype": "BF16", "shape": [8, 4], "buffer": "qkv",
 *    "segments": [{"start": [0, 0], "size": [8, 4], "offset": 0, "strides": [4, 1]}]}
 *
 * where each segment puts the box start/size of the tensor at element
 * `offset` of the buffer with element `strides` (row-major when left out),
 * elements of the tensor's dtype. A buffer is bytes: several tensors, of
 * one dtype or of several (FP8 weights and their F32 scales, a packed arena
 * of small tensors), may share one buffer, named by the same "buffer" with
 * the same data and bytes; no two of their segments may share a byte.
 * "buffer" defaults to the tensor's name. Registered with the coordinator
 * at refit_source_join() (or the first publish); tensors added later
 * re-register the source.
 *
 * In a build with CUDA a shard may be GPU memory. The source serves it
 * from a pinned host mirror that each publish fills (a device-to-host copy:
 * receivers' gathers and GETs over tcp are answered by CPU copies);
 * the trainer may then write its shard again as soon as publish returns, and,
 * as in snapshot mode, a publish first waits (up to coordinator.timeout_ms)
 * until no receiver still reads the mirror's previous version.
 *
 * @param [in] source       The source.
 * @param [in] tensor_json  The description, NUL-terminated.
 * @param [in] data         The shard's buffer (host memory, or GPU memory
 *                          with CUDA); the library reads it, never writes it.
 * @param [in] bytes        The buffer's size.
 *
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT for a bad description, a tensor
 *         added twice, a buffer too small for its segments, segments that
 *         share a byte (naming both), or a shared buffer given with another
 *         address or size; REFIT_UNSUPPORTED for GPU memory in a build
 *         without CUDA. Nothing is registered on failure.
 * @note The thread that owns the handle. Maps the buffer for remote reads
 *       (UCX memory registration); no coordinator call.
 */
REFIT_EXPORT refit_status_t refit_source_add_tensor(refit_source_t* source, const char* tensor_json,
                                                    void* data, uint64_t bytes);

/**
 * Registers this source's tensors with the coordinator, so that receivers
 * can plan with it. Called by the first publish if not before.
 *
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT when no tensor was added or the
 *         coordinator refuses the registration (a rank already registered
 *         by another live connection, a tensor declared otherwise by other
 *         sources: the message names it); REFIT_IO_ERROR or REFIT_TIMEOUT
 *         when the coordinator cannot be reached.
 * @note The thread that owns the handle. Blocks on one coordinator call,
 *       at most "coordinator.timeout_ms".
 */
REFIT_EXPORT refit_status_t refit_source_join(refit_source_t* source);

/**
 * Says that this rank's shards now hold version `version`, which must be
 * greater than every version this source published before.
 *
 * @return REFIT_OK once the coordinator has it; REFIT_INVALID_ARGUMENT for a
 *         version not newer (naming both) or a source with no tensor;
 *         REFIT_IO_ERROR or REFIT_TIMEOUT when the coordinator cannot be
 *         reached.
 * @note The thread that owns the handle. Blocks on the coordinator (join
 *       first, if not joined) and, in snapshot mode or with a mirror, on
 *       receivers still reading the previous copy; each at most
 *       "coordinator.timeout_ms". Copies the shards (snapshot, mirror).
 */
REFIT_EXPORT refit_status_t refit_source_publish(refit_source_t* source, int64_t version);

/**
 * Waits until no receiver reads `version` or an older one from the sources
 * (every lease on it released or expired): then the trainer may overwrite
 * its shards. From then on no receiver is granted `version` or an older one
 * again (see "Versions, leases and commits").
 *
 * @param [in] timeout_ms  How long to wait (see REFIT_NO_DEADLINE).
 *
 * @return REFIT_OK when drained; REFIT_TIMEOUT when leases remain after
 *         `timeout_ms`; REFIT_INVALID_ARGUMENT before join;
 *         REFIT_IO_ERROR when the coordinator cannot be reached.
 * @note The thread that owns the handle. Blocks on the coordinator's
 *       drained notice, at most `timeout_ms` (a request itself at most
 *       "coordinator.timeout_ms").
 */
REFIT_EXPORT refit_status_t refit_source_wait_drained(refit_source_t* source, int64_t version,
                                                      int64_t timeout_ms);

/**
 * Leaves the membership and frees everything: the agent's threads are
 * joined, its memory registrations released (the shards are no longer
 * read), and an embedded coordinator stopped. NULL is a no-op.
 *
 * @note The thread that owns the handle; the handle is invalid after.
 *       Blocks on one coordinator call (at most "coordinator.timeout_ms").
 */
REFIT_EXPORT void refit_source_destroy(refit_source_t* source);

/* ---- Receiver (inference side) ------------------------------------------ */

/**
 * Creates a receiver from its JSON config and connects to the coordinator
 * (starting it first with "embedded"). Starts the agent's threads.
 *
 * @param [in]  config_json  The config (the keys above), NUL-terminated.
 * @param [out] out          The new receiver; NULL on failure.
 *
 * @return As refit_source_create(); also REFIT_NOT_FOUND or
 *         REFIT_INVALID_ARGUMENT for a "recipe" whose model cannot be read.
 * @note Any thread. Blocks for the connection and its handshake, at most
 *       "coordinator.timeout_ms".
 */
REFIT_EXPORT refit_status_t refit_receiver_create(const char* config_json, refit_receiver_t** out);

/**
 * Registers a buffer to be filled on refresh, [data, data + bytes), valid
 * until refit_receiver_destroy(). One of:
 *
 *   explicit segments (several tensors may share the buffer):
 *     {"name": "qkv", "dtype": "BF16",
 *      "segments": [{"tensor": "q", "start": [0, 0], "size": [4, 4],
 *                    "offset": 0, "strides": [4, 1]}, ...]}
 *   a DTensor spec (the buffer holds this rank's shard, contiguous):
 *     {"name": "w", "dtype": "BF16", "shape": [10, 6],
 *      "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["S(1)"]}}
 *   a recipe parameter name (the config's "recipe" says how it is laid out),
 *   in the sources' dtype or, with "dtype", in one refit converts to (below):
 *     {"recipe": "model.layers.0.self_attn.qkv_proj.weight"}
 *     {"recipe": "model.layers.0.self_attn.qkv_proj.weight", "dtype": "BF16"}
 *
 * A buffer is bytes: each segment's elements are of its tensor's dtype,
 * which the segment may name ("dtype" in the segment; the buffer's
 * "dtype" is the default, and may be left out when every segment names
 * one), and `offset` and `strides` count elements of it. So one buffer may
 * hold BF16 weights and their F32 scales:
 *     {"name": "fused", "segments": [
 *        {"tensor": "w", "dtype": "BF16", "start": [0, 0], "size": [16, 8], "offset": 0},
 *        {"tensor": "w_scale", "dtype": "F32", "start": [0], "size": [4], "offset": 64}]}
 * A segment's dtype is the one the sources declare for its tensor, or one
 * refit converts it to on the way (docs/conversion.md): F32 to BF16 or F16,
 * BF16 to F16 (round to nearest even), BF16 or F32 to F8_E4M3 with one F32
 * scale per block of "weight_block_size", which the receivers compute into
 * the tensor "<name>_scale_inv" (F32, the weight's last two dims divided by
 * the block, rounded up) that some buffer of theirs must hold wherever they
 * hold blocks of the weight, each box covering whole blocks. Any other pair
 * is refused at join, naming the tensor and both dtypes. The rank that
 * pulls a unit converts it after it lands and passes the converted bytes and
 * scales to the other ranks of its domain; a block with NaN or infinity
 * fails the refresh, naming the tensor and the block (staged mode keeps the
 * old version; direct mode's buffers are torn, as on any failure: units
 * converted before the refused one hold the new version). GPU buffers
 * take the CUDA kernel (a build with CUDA and nvcc). No two segments may
 * share a byte.
 *
 * @param [in] receiver     The receiver.
 * @param [in] buffer_json  The description, NUL-terminated.
 * @param [in] data         The buffer (host memory, or GPU memory with
 *                          CUDA and "local": {"fabric": "nccl"}).
 * @param [in] bytes        Its size: at least what the segments reach; for
 *                          a recipe parameter, exactly the size the recipe
 *                          gives that parameter at this rank (its shard,
 *                          fused and padded as the framework allocates it).
 *
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT for a bad description, a buffer
 *         too small, a recipe parameter of another size than the recipe's
 *         (naming both sizes), segments that share a byte (naming both), or a refresh
 *         running; REFIT_NOT_FOUND for a recipe name the recipe does not
 *         give this rank. Nothing is registered on failure. Bytes outside
 *         every segment are never written.
 * @note The thread that owns the handle. Maps the buffer (UCX memory
 *       registration); no coordinator call.
 */
REFIT_EXPORT refit_status_t refit_receiver_add_buffer(refit_receiver_t* receiver, const char* buffer_json,
                                                      void* data, uint64_t bytes);

/**
 * Registers this receiver's buffers with the coordinator. Called by the
 * first refresh if not before. Every rank of a domain should have joined
 * before any of them refreshes: a domain's ranks execute one plan together.
 *
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT, naming the buffer and the
 *         problem, when a buffer cannot be planned against the tensors the
 *         joined sources declare (a tensor none of them declares, a box
 *         outside the tensor, another dtype or number of dims), when
 *         "instance_ranks" disagrees with the instance's other ranks, when
 *         this rank is registered by another live connection, or while a
 *         started refresh runs; nothing of the other members changes.
 *         REFIT_IO_ERROR or REFIT_TIMEOUT when the coordinator cannot be
 *         reached. A receiver that joins before any source is checked when
 *         it refreshes (its refresh fails, naming the problem; the others
 *         are planned without it).
 * @note The thread that owns the handle. Blocks on one coordinator call,
 *       at most "coordinator.timeout_ms".
 */
REFIT_EXPORT refit_status_t refit_receiver_join(refit_receiver_t* receiver);

/**
 * Fills the buffers with `version` (or REFIT_LATEST), blocking until done,
 * failed, or `timeout_ms` passed. The deadline covers the refresh's
 * coordinator calls too, but for three whose answer must be read once sent:
 * the registration (join), the staged report and the withdrawal (staged
 * mode, below); a refresh that failed at its deadline takes at most 500 ms
 * more to release its lease. Failures a
 * server may act on: REFIT_PEER_LOST (a peer died or left, and the retries
 * until the deadline did not get past it), REFIT_ABORTED (staged: the
 * instance aborted the version), REFIT_VERIFY_FAILED ("verify": the bytes
 * are not the ones published), REFIT_TIMEOUT; REFIT_IO_ERROR for others of
 * the network, a lost lease, or a thread the system refused.
 *
 * Direct mode: the server must not read the buffers while a refresh runs;
 * on failure they are torn, the status says so, and refit_receiver_version()
 * returns 0 until a refresh succeeds.
 *
 * Staged mode: the server goes on reading its buffers. REFIT_OK means the
 * version is staged on every rank of this instance and the coordinator has
 * said commit: call refit_receiver_commit() in a pause. On failure (here or
 * on any rank of the instance) the buffers keep the old version. Every
 * rank of an instance ends a version the same way ("Versions, leases and
 * commits"); REFIT_OK may come one coordinator round trip after timeout_ms.
 *
 * @param [in] version     A version >= 1, or REFIT_LATEST.
 * @param [in] timeout_ms  The refresh's deadline (see REFIT_NO_DEADLINE).
 *
 * @return REFIT_OK; REFIT_TIMEOUT when the deadline passed (the version was
 *         not published, a rank of the domain or instance did not come);
 *         REFIT_NOT_FOUND for a version drained or older than the latest;
 *         REFIT_IO_ERROR when a peer or the coordinator failed, the lease
 *         was lost, verification found other bytes, or the instance
 *         aborted the version; REFIT_INVALID_ARGUMENT for a bad version, a
 *         started refresh still running, a registration the coordinator
 *         refuses, or a source block the conversion on the way refuses (NaN
 *         or infinity; not retried). A failure a new attempt can fix (a
 *         peer that died) is retried within the deadline.
 * @note The thread that owns the handle. Blocks on the coordinator (the
 *       version, the lease, the plan, the commit decision), on the
 *       transfers and on the other ranks of the domain and instance; all
 *       within `timeout_ms` but for the commit decision's round trip. The
 *       agent's threads move the data meanwhile.
 */
REFIT_EXPORT refit_status_t refit_receiver_refresh(refit_receiver_t* receiver, int64_t version,
                                                   int64_t timeout_ms);

/**
 * Staged mode, after a refresh returned REFIT_OK: copies the staged version
 * into the server's buffers (only the bytes the refresh wrote) and makes it
 * the version refit_receiver_version() returns. The server pauses reading
 * around this call; its duration is the report's "pause_seconds".
 *
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT when nothing is staged, in
 *         direct mode, or while a started refresh runs.
 * @note The thread that owns the handle. Blocks on the copies only (host
 *       memcpy, or device copies on the GPU); no coordinator call.
 */
REFIT_EXPORT refit_status_t refit_receiver_commit(refit_receiver_t* receiver);

/**
 * Starts the same refresh as refit_receiver_refresh() on a thread of the
 * library and returns at once; refit_receiver_refresh_poll() or
 * refit_receiver_refresh_wait() gives its result.
 *
 * @return REFIT_OK when started; REFIT_INVALID_ARGUMENT for a bad version
 *         or a started refresh still running.
 * @note The thread that owns the handle. Never blocks on the refresh; joins
 *       the thread of the previous started refresh, which has finished.
 *       While it runs, only poll, wait, report, version and destroy may be
 *       called on the handle.
 */
REFIT_EXPORT refit_status_t refit_receiver_refresh_start(refit_receiver_t* receiver, int64_t version,
                                                         int64_t timeout_ms);

/**
 * @return REFIT_IN_PROGRESS while the started refresh runs, then its result
 *         (as refit_receiver_refresh() returns it, with its last error);
 *         the last started refresh's result again on later calls.
 * @note The thread that owns the handle; never blocks.
 */
REFIT_EXPORT refit_status_t refit_receiver_refresh_poll(refit_receiver_t* receiver);

/**
 * Waits at most `timeout_ms` (see REFIT_NO_DEADLINE) for the started
 * refresh.
 *
 * @return Its result, or REFIT_IN_PROGRESS if it still runs.
 * @note The thread that owns the handle. Blocks on the refresh's end, at
 *       most `timeout_ms`.
 */
REFIT_EXPORT refit_status_t refit_receiver_refresh_wait(refit_receiver_t* receiver, int64_t timeout_ms);

/**
 * The report of the last finished refresh, JSON: {"version", "mode", "ok",
 * "error", "epoch", "network_bytes" (this rank pulled), "local_bytes" (this
 * rank passed on), "minimum_network_bytes" (of the whole plan, all domains),
 * "pulls", "pushes", "retries", "seconds": {"plan", "network", "local",
 * "total"}, "pause_seconds", in staged mode "committed", "solo": true when
 * the coordinator had this rank pull everything itself (a retry after the
 * membership changed during the version, or another instance aborted it;
 * "minimum_network_bytes" is then that plan's), and with "verify"
 * "verify": {"boxes", "bytes" (checked), "unverified_bytes", "seconds"},
 * "converts": {"units" (this rank converted after landing them), "seconds"
 * (its conversion kernels took)}, and
 * when GETs went through the landing ring "landing": {"slots", "chunks",
 * "copies", "held" (chunks whose GET waited for a slot)}}. "{}" before
 * the first, and while a started refresh runs.
 *
 * @return The report, owned by the receiver, valid until its next refresh
 *         starts or it is destroyed: refit_receiver_commit() leaves the
 *         pointer returned before it valid and unchanged (a report taken
 *         after the commit carries "committed" and "pause_seconds"). "{}"
 *         for a NULL receiver.
 * @note The thread that owns the handle; never blocks.
 */
REFIT_EXPORT const char* refit_receiver_report(refit_receiver_t* receiver);

/**
 * The version the buffers hold: 0 before the first refresh, and after a
 * direct refresh that failed once it had begun writing (the buffers are torn).
 * A refresh that failed before any transfer began (the version never came,
 * the coordinator refused) leaves it as it was. Staged mode: the version
 * last committed.
 *
 * @return The version; 0 for a NULL receiver.
 * @note The thread that owns the handle, or any thread while a started
 *       refresh runs (it is read atomically); never blocks.
 */
REFIT_EXPORT int64_t refit_receiver_version(refit_receiver_t* receiver);

/*
 * Where the receiver's refresh stands, read while it runs: for a server
 * that shows progress, or times something on the transfer. The caller
 * sets `size` to sizeof(refit_progress_t) as its header has it; the
 * library writes the fields that size covers, so a caller built against
 * an older header keeps working when fields are appended.
 */
typedef struct refit_progress {
  uint32_t size;     /* in: sizeof(refit_progress_t) of the caller */
  uint32_t attempt;  /* the refresh's attempt, from 1; 0 before the first refresh */
  int64_t version;   /* the version the attempt pulls; 0 until its transfer begins */
  /* The receiver's state, a static string: "idle", "joined", "version
   * known", "leased", "transferring", "landed", "verified", "staged",
   * "committed", "failed" or "aborted" (docs/receiver.md). */
  const char* state;
  /* The network bytes this rank pulls in the attempt (its GETs and
   * gathers), and how many of them have landed. Both 0 until the
   * attempt's plan part is compiled; each attempt counts afresh. A
   * finished refresh keeps its last attempt's figures. */
  uint64_t network_bytes_planned;
  uint64_t network_bytes_landed;
} refit_progress_t;

/**
 * Fills `*out` with where the receiver's refresh stands (refit_progress_t).
 *
 * @param out  Its `size` set by the caller, at least offsetof(refit_progress_t,
 *             state) + sizeof(const char*); the fields past `size` are not
 *             written.
 * @return REFIT_OK; REFIT_INVALID_ARGUMENT for a NULL receiver or `out`, or
 *         a `size` too small, naming it.
 * @note Any thread, also while a started refresh runs (every field is read
 *       atomically; the byte counts of one call may be from two moments of
 *       the transfer, landed never above planned); never blocks.
 */
REFIT_EXPORT refit_status_t refit_receiver_progress(refit_receiver_t* receiver, refit_progress_t* out);

/**
 * Leaves the membership and frees everything: waits for a started refresh
 * to end, joins the agent's threads, releases the buffers' registrations
 * (they are not written after) and stops an embedded coordinator. NULL is
 * a no-op.
 *
 * @note The thread that owns the handle; the handle is invalid after.
 *       Blocks on a started refresh (up to its own deadline), on the
 *       refresh summaries still queued for the coordinator's metrics (at
 *       most 500 ms together; the rest are dropped) and on one coordinator
 *       call (at most "coordinator.timeout_ms").
 */
REFIT_EXPORT void refit_receiver_destroy(refit_receiver_t* receiver);

/* ---- The function table ------------------------------------------------- */

/*
 * Every entry point, for a server that resolves one symbol. The table only
 * grows, at its end, within one REFIT_ABI_VERSION: a caller built against
 * a newer header reads an entry only when `size` covers it
 * (offsetof(refit_api_t, entry) < size). Appended since the first table:
 * set_log_callback, receiver_progress.
 */
typedef struct refit_api {
  uint32_t abi_version; /* REFIT_ABI_VERSION */
  uint32_t size;        /* sizeof(refit_api_t) of the library */
  const char* (*version)(void);
  const char* (*last_error)(void);
  const char* (*status_name)(refit_status_t status);
  refit_status_t (*source_create)(const char* config_json, refit_source_t** out);
  refit_status_t (*source_add_tensor)(refit_source_t* source, const char* tensor_json, void* data,
                                      uint64_t bytes);
  refit_status_t (*source_join)(refit_source_t* source);
  refit_status_t (*source_publish)(refit_source_t* source, int64_t version);
  refit_status_t (*source_wait_drained)(refit_source_t* source, int64_t version, int64_t timeout_ms);
  void (*source_destroy)(refit_source_t* source);
  refit_status_t (*receiver_create)(const char* config_json, refit_receiver_t** out);
  refit_status_t (*receiver_add_buffer)(refit_receiver_t* receiver, const char* buffer_json, void* data,
                                        uint64_t bytes);
  refit_status_t (*receiver_join)(refit_receiver_t* receiver);
  refit_status_t (*receiver_refresh)(refit_receiver_t* receiver, int64_t version, int64_t timeout_ms);
  refit_status_t (*receiver_refresh_start)(refit_receiver_t* receiver, int64_t version, int64_t timeout_ms);
  refit_status_t (*receiver_refresh_poll)(refit_receiver_t* receiver);
  refit_status_t (*receiver_refresh_wait)(refit_receiver_t* receiver, int64_t timeout_ms);
  const char* (*receiver_report)(refit_receiver_t* receiver);
  int64_t (*receiver_version)(refit_receiver_t* receiver);
  void (*receiver_destroy)(refit_receiver_t* receiver);
  refit_status_t (*receiver_commit)(refit_receiver_t* receiver);
  void (*set_log_callback)(refit_log_fn fn, void* user);
  refit_status_t (*receiver_progress)(refit_receiver_t* receiver, refit_progress_t* out);
} refit_api_t;

/**
 * The table of every entry point for `abi_version`, or NULL (and a last
 * error) for a version this library does not serve. Static; any thread.
 */
REFIT_EXPORT const refit_api_t* refit_get_api(uint32_t abi_version);

#ifdef __cplusplus
}
#endif
