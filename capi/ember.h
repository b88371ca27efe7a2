/* ember.h — the C interface to the Ember worker (libember.so).
 *
 * A thin, stable C ABI over ember::Worker (worker/worker.h) for C programs and
 * language bindings (the Python package in python/ember uses it via ctypes).
 * Every function is extern "C", returns plain integers and never lets a C++
 * exception or an abort escape for bad input: a NULL handle, a bad config
 * path, an absent server, an unknown key or a wrong size each come back as an
 * error code with a message.
 *
 * Conventions that hold for every function below unless it says otherwise:
 *
 *   Return value. Functions returning `int` return EMBER_OK (0) on success or
 *   an EMBER_E_* code (> 0) on failure; ember_wait may also return
 *   EMBER_PENDING (< 0), which is not an error. The codes are the numbers of
 *   ember::ErrorCode (common/base/error.h), append only, never renumbered.
 *
 *   Out of memory. Any `int`-returning function can fail with
 *   EMBER_E_INTERNAL when memory runs out or a C++ exception reaches the
 *   boundary; the lists below name it only where it has another cause.
 *
 *   Last error. Every `int`-returning function sets this thread's last error:
 *   on failure ember_last_error() gives "<code name>: <message>" (the message
 *   names the thing that failed and what to do), on success it is "".
 *   The text is thread-local, so concurrent callers never see each other's
 *   errors.
 *
 *   Output parameters. Pointers named out_* may be NULL when the caller does
 *   not want that value, except where the function says "required". They
 *   are written only on success.
 *
 *   Tensors. Parameters and gradients are float32, C order, host memory;
 *   sizes are given as element counts (num_elements), never bytes, except
 *   for ember_alloc which takes bytes.
 *
 *   Thread-safety. All functions may be called from any thread at the same
 *   time, on the same or different handles, except the destroy/free
 *   functions: nothing else may be using (or still be about to use) the
 *   handle being destroyed.
 *
 *   Handles. ember_worker, ember_request and ember_pipeline are opaque.
 *   Passing NULL where a handle is required returns EMBER_E_INVALID_ARGUMENT.
 *   Handles carry a tag that is checked on entry, so passing a destroyed
 *   handle is usually caught too (EMBER_E_INVALID_ARGUMENT), but that check
 *   is a diagnostic aid, not a guarantee: do not use a handle after freeing.
 *
 *   Blocking. Functions marked "blocks" wait for a reply, bounded by the
 *   config's [worker] request_timeout (EMBER_E_TIMEOUT then); a zero-copy
 *   send can keep an operation up to heartbeat_timeout longer, and a
 *   reconnect already under way up to connect_timeout (worker/worker.h,
 *   "Asynchrony"). The functions that send (ember_*_async, the pipeline
 *   functions that flush) return once the request is handed over; they wait
 *   only for room (a full send queue or shm ring: at most 30 s, then
 *   EMBER_E_TIMEOUT), for a lost connection being re-established (bounded
 *   by request_timeout), or for another thread's request of the same key to
 *   be handed over (at most request_timeout, then EMBER_E_TIMEOUT and nothing
 *   is sent; a request of a key leaves in step order, worker.h). The others
 *   never wait on the network.
 *   No function calls back into the caller.
 *
 * Versioning: the library's SONAME is libember.so.<EMBER_ABI_VERSION>; the
 * ABI version changes when an existing function's signature or meaning
 * changes. New functions and error codes may be added within an ABI version.
 */
#ifndef EMBER_CAPI_EMBER_H_
#define EMBER_CAPI_EMBER_H_

#include <stddef.h>
#include <stdint.h>

#if defined(EMBER_CAPI_BUILDING)
#define EMBER_API __attribute__((visibility("default")))
#else
#define EMBER_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version: the SONAME's major number (libember.so.0). */
#define EMBER_ABI_VERSION 0

/* Status codes. EMBER_OK and EMBER_E_* equal ember::ErrorCode's values (a
 * static_assert in ember.cc ties each one); EMBER_PENDING is C-only. */
typedef enum ember_status {
  EMBER_PENDING = -1,              /* ember_wait: the request is still running (not an error) */
  EMBER_OK = 0,
  EMBER_E_INVALID_ARGUMENT = 1,    /* a caller-supplied value is NULL, out of range or malformed */
  EMBER_E_CONFIG = 2,              /* the config file is missing, unreadable or invalid */
  EMBER_E_POOL_EXHAUSTED = 3,      /* the page pool has no block of the requested class */
  EMBER_E_TOO_LARGE = 4,           /* a request exceeds a configured or structural maximum */
  EMBER_E_MALFORMED_FRAME = 5,     /* a frame failed a structural check */
  EMBER_E_CHECKSUM_MISMATCH = 6,   /* a frame's CRC32C does not match its bytes */
  EMBER_E_IO = 7,                  /* a system call failed (connection refused, ...) */
  EMBER_E_CLOSED = 8,              /* the connection or the worker is closed */
  EMBER_E_TIMEOUT = 9,             /* a deadline passed (connect, request_timeout) */
  EMBER_E_NOT_FOUND = 10,          /* an unknown key (not init-ed), file or peer */
  EMBER_E_SHAPE_MISMATCH = 11,     /* a tensor's shape differs from the registered one */
  EMBER_E_PROTOCOL = 12,           /* the peer broke the protocol */
  EMBER_E_AUTH = 13,               /* handshake authentication failed (auth_token) */
  EMBER_E_VERSION_MISMATCH = 14,   /* protocol version differs between worker and server */
  EMBER_E_UNAVAILABLE = 15,        /* a resource or device is not present */
  EMBER_E_WORKER_LOST = 16,        /* a worker vanished: loss policy "fail", or "wait" and
                                    * it was not back within worker_timeout */
  EMBER_E_STALE = 17,              /* a push for a step whose round is already over */
  EMBER_E_CANCELLED = 18,          /* the operation was cancelled by shutdown */
  EMBER_E_INTERNAL = 19,           /* an internal failure (also: out of memory, a C++ exception) */
  EMBER_E_CORRUPT = 20,            /* stored data (checkpoint) failed validation */
  EMBER_E_OUT_OF_STEP = 21         /* the step does not follow the server's (it restarted from an
                                    * older checkpoint): ember_step now gives the server's step;
                                    * pull at it and continue from there */
} ember_status;

/* rank argument of ember_worker_create: keep [worker] rank from the config. */
#define EMBER_RANK_FROM_CONFIG (-1)

/* timeout_ms argument of ember_wait: wait until done (bounded as "Blocking"
 * above says: request_timeout, plus up to heartbeat_timeout for a zero-copy
 * send still in flight). */
#define EMBER_WAIT_FOREVER (-1)

typedef struct ember_worker ember_worker;      /* a connected worker */
typedef struct ember_request ember_request;    /* one asynchronous operation */
typedef struct ember_pipeline ember_pipeline;  /* a batching scope over a worker */

/* ------------------------------------------------------------------------
 * Library information and errors. None of these block; all are thread-safe.
 */

/* The library version, "MAJOR.MINOR.PATCH" (static storage, never freed). */
EMBER_API const char* ember_version(void);

/* EMBER_ABI_VERSION of the library actually loaded (compare with the header's). */
EMBER_API int ember_abi_version(void);

/* Short stable name of a status code: "ok", "pending", "invalid_argument",
 * "not_found", ...; "unknown" for a number that is no code. Static storage. */
EMBER_API const char* ember_error_name(int code);

/* This thread's last error text: "" after a success, else
 * "<code name>: <message>". The pointer stays valid until the next ember_*
 * call on this thread; copy it to keep it. Never NULL. Does not itself
 * change the last error. */
EMBER_API const char* ember_last_error(void);

/* This thread's last status code (EMBER_OK after a success). */
EMBER_API int ember_last_error_code(void);

/* Sets the level of Ember's log messages ("trace", "debug", "info", "warn",
 * "error", "critical", "off"); they go to stderr. This replaces spdlog's
 * default logger, so it affects the whole process. Until called, the first
 * ember_worker_create sets "warn" on stderr — unless the host program has
 * installed its own spdlog default logger (a named one), which is then used
 * as it is.
 * Errors: EMBER_E_INVALID_ARGUMENT (NULL or an unknown level name). */
EMBER_API int ember_set_log_level(const char* level);

/* ------------------------------------------------------------------------
 * Worker lifetime.
 */

/* Loads the TOML config at `config_path` (the same file the servers use),
 * applies `overrides` ("table.key=value" strings, e.g.
 * "worker.connect_retries=0"; num_overrides may be 0 with overrides NULL),
 * then, when rank >= 0, sets [worker] rank = rank, validates, connects to
 * every server and joins the job.
 * Blocks: connecting retries up to [worker] connect_retries times, each
 * attempt bounded by connect_timeout, with back-off between attempts.
 * Ownership: on success *out_worker (required) is a new worker the caller
 * frees with ember_worker_destroy. The strings are not kept.
 * Errors:
 *   EMBER_E_INVALID_ARGUMENT  config_path or out_worker NULL, overrides NULL
 *                             with num_overrides > 0 or holding NULL, rank
 *                             below -1 or above UINT32_MAX
 *   EMBER_E_CONFIG            the file is missing/unreadable/invalid, a bad
 *                             override, rank >= [cluster] num_workers, a
 *                             server with another [cluster] table, two
 *                             servers with different consistency, loss
 *                             policy or [optimizer] settings
 *   EMBER_E_IO, EMBER_E_TIMEOUT  a server unreachable after the retries
 *                             (the message names the server and the knobs)
 *   EMBER_E_AUTH, EMBER_E_VERSION_MISMATCH, EMBER_E_PROTOCOL  handshake refused
 *   EMBER_E_UNAVAILABLE       transport "rdma" with no active RDMA port,
 *                             pool_backing "hugetlb"/"thp" this host cannot
 *                             give, or a server still refusing the join after
 *                             the retries because this rank is connected
 *                             already (two workers given one rank, or a
 *                             predecessor not yet declared lost)
 *   EMBER_E_IO                also: pre-faulting the page pool failed, or the
 *                             record_pattern file cannot be created
 *   EMBER_E_INTERNAL          out of memory */
EMBER_API int ember_worker_create(const char* config_path, int64_t rank,
                                  const char* const* overrides, size_t num_overrides,
                                  ember_worker** out_worker);

/* Closes the connections and frees the worker, every buffer from ember_alloc
 * that was not freed and every pipeline not destroyed (their pointers become
 * invalid). Requests still running fail with EMBER_E_CLOSED; their
 * ember_request handles stay valid until ember_request_free.
 * Pre: no thread is inside another call on this worker, and no running
 * request still reads or writes a buffer from ember_alloc (wait for them).
 * Blocks until the worker's I/O threads have stopped. NULL is a no-op.
 * Does not change the last error. */
EMBER_API void ember_worker_destroy(ember_worker* worker);

/* This worker's rank, the job's number of workers and of servers; any out
 * pointer may be NULL. Errors: EMBER_E_INVALID_ARGUMENT (worker NULL). */
EMBER_API int ember_worker_info(const ember_worker* worker, uint32_t* out_rank,
                                uint32_t* out_num_workers, uint32_t* out_num_servers);

/* The step the next push of `key` will use (0 for a key not init-ed here).
 * Errors: EMBER_E_INVALID_ARGUMENT (worker or out_step NULL; out_step is
 * required). */
EMBER_API int ember_step(const ember_worker* worker, uint64_t key, uint64_t* out_step);

/* ------------------------------------------------------------------------
 * Pool buffers: memory a gradient can leave from without a copy.
 */

/* Allocates `bytes` (> 0) of page-pool memory (4 KiB aligned; above the
 * pool's largest block, 64 MiB, a run of consecutive blocks), or page-aligned
 * heap memory when the pool cannot hold it ([communication] prealloc_pages)
 * — ember_buffer_info tells which. Contents are unspecified. Never blocks.
 * Ownership: *out_data (required) belongs to the worker; release it with
 * ember_free, or it is released by ember_worker_destroy. Valid until then.
 * Errors: EMBER_E_INVALID_ARGUMENT (NULL arguments, bytes == 0),
 *         EMBER_E_TOO_LARGE (bytes that cannot be allocated at all). */
EMBER_API int ember_alloc(ember_worker* worker, size_t bytes, void** out_data);

/* Releases a buffer from ember_alloc of this worker. NULL data is a no-op.
 * A buffer that an asynchronous or pipelined request started with a pointer
 * into it still uses (not done yet: over shm the server may still read it)
 * is not freed (a pipelined one is done only after a flush: wait with
 * ember_pipeline_wait). Pre: no call on another thread uses it or is about
 * to (the check sees requests whose start call returned).
 * Errors: EMBER_E_INVALID_ARGUMENT (worker NULL; data not a live buffer of
 * this worker, e.g. freed twice or from another worker; a running request
 * still uses it: wait for it first. Nothing is freed then). */
EMBER_API int ember_free(ember_worker* worker, void* data);

/* Size in bytes of the buffer starting at `data` and whether it lies in the
 * page pool (1) or in heap memory (0). Never blocks.
 * Errors: EMBER_E_INVALID_ARGUMENT (worker or data NULL),
 *         EMBER_E_NOT_FOUND (data is not the start of a live buffer of this worker). */
EMBER_API int ember_buffer_info(const ember_worker* worker, const void* data, size_t* out_bytes,
                                int* out_in_pool);

/* ------------------------------------------------------------------------
 * Tensors. Keys are the caller's 64-bit names of tensors; every worker of a
 * job uses the same key for the same tensor.
 * Besides the errors each function lists, a request to a server that was
 * restarted with another [cluster] table, consistency or [optimizer]
 * settings than the other servers fails with EMBER_E_CONFIG: the worker
 * refuses it when it reconnects (see ember_worker_create).
 */

/* Registers `key` as a float32 tensor of `shape` (ndim <= 8 dims, C order;
 * ndim 0 is a scalar, shape may then be NULL). Rank 0 passes the initial
 * parameters (num_values == product of shape); other ranks pass values NULL
 * and num_values 0 and wait until rank 0 has registered the key. Calling it
 * again with the same shape is a no-op.
 * Blocks until every server holding part of the tensor has answered.
 * Ownership: shape and values are read during the call only.
 * out_step: the step to compute next (0 for a fresh job; later after a
 * restart of this worker). After such a restart (rejoin) the steps of keys
 * can differ by one (keys pushed before the restart are ahead): resume at
 * the smallest step s, and in step s pull, not push, the keys whose
 * ember_step is already s + 1, or every worker waits until request_timeout
 * (docs/troubleshooting.md#worker-loss).
 * Errors: EMBER_E_INVALID_ARGUMENT (worker NULL, shape NULL with ndim > 0,
 *   values NULL with num_values > 0, more than 8 dims, num_values not the
 *   element count), EMBER_E_TOO_LARGE (the tensor is larger than this
 *   host's physical memory: every rank pulls all of it), EMBER_E_SHAPE_MISMATCH
 *   (the key exists with another shape), EMBER_E_WORKER_LOST (rank 0 lost
 *   while waiting), EMBER_E_INVALID_ARGUMENT from the server (a chunk layout
 *   other than its partition_bytes and server list give: workers and servers
 *   configured differently), EMBER_E_CLOSED, EMBER_E_TIMEOUT, and EMBER_E_IO /
 *   EMBER_E_AUTH / EMBER_E_VERSION_MISMATCH / EMBER_E_PROTOCOL / EMBER_E_CONFIG
 *   from a reconnect, as for ember_push. After a failed init the
 *   key is not this worker's: its push and pull fail with EMBER_E_NOT_FOUND
 *   until an init succeeds. */
EMBER_API int ember_init(ember_worker* worker, uint64_t key, const uint64_t* shape, size_t ndim,
                         const float* values, size_t num_values, uint64_t* out_step);

/* Sends this step's gradient of `key` (num_elements float32 values) and
 * advances the key's step. Blocks until the servers have accepted it.
 * out_step: the step pushed.
 * Ownership: gradient is read during the call only.
 * Errors: EMBER_E_INVALID_ARGUMENT (worker/gradient NULL, num_elements not
 *   the key's element count), EMBER_E_NOT_FOUND (key not init-ed by this
 *   worker, or its init failed), EMBER_E_SHAPE_MISMATCH, EMBER_E_STALE (bsp:
 *   the step's round is
 *   over), EMBER_E_OUT_OF_STEP (bsp: the server is at an earlier step; the
 *   key's step is now the server's, see ember_step), EMBER_E_CLOSED,
 *   EMBER_E_TIMEOUT, EMBER_E_IO (a server stayed unreachable: "cannot
 *   connect ... 1 attempt"), EMBER_E_AUTH / EMBER_E_VERSION_MISMATCH (a
 *   reconnect was refused), EMBER_E_PROTOCOL (a reply of the wrong size),
 *   EMBER_E_CONFIG (a reconnect's join refused, as in ember_worker_create).
 *   The server also answers EMBER_E_INVALID_ARGUMENT to a push more than 64
 *   steps past the key's open round: pull before pushing further. */
EMBER_API int ember_push(ember_worker* worker, uint64_t key, const float* gradient,
                         size_t num_elements, uint64_t* out_step);

/* Receives into `out` (num_elements float32) the parameters of `key` that
 * include every push this worker made (bsp: every worker's pushes of those
 * steps). Blocks until they are in. out_step: the step to compute next.
 * Errors: EMBER_E_INVALID_ARGUMENT (worker/out NULL, wrong num_elements),
 *   EMBER_E_NOT_FOUND, EMBER_E_WORKER_LOST, EMBER_E_OUT_OF_STEP (bsp/ssp: the
 *   step needs pushes of this worker the server never received; the key's
 *   step is now the server's, unless this worker's own pushes of the key are
 *   still unanswered: then the pull overtook them and the step stays), EMBER_E_CLOSED, EMBER_E_TIMEOUT, and
 *   EMBER_E_IO / EMBER_E_AUTH / EMBER_E_VERSION_MISMATCH / EMBER_E_PROTOCOL
 *   as for ember_push. */
EMBER_API int ember_pull(ember_worker* worker, uint64_t key, float* out, size_t num_elements,
                         uint64_t* out_step);

/* Push then pull in one round trip (gradient and out may be the same
 * buffer). Blocks. Errors: those of ember_push and ember_pull. */
EMBER_API int ember_push_pull(ember_worker* worker, uint64_t key, const float* gradient,
                              float* out, size_t num_elements, uint64_t* out_step);

/* Asynchronous forms of push, pull and push_pull: they start the operation
 * and return with *out_request (required), which the caller waits on with
 * ember_wait and frees with ember_request_free. They return once the request
 * is handed to the transport, which waits only as "Blocking" above says (a
 * full channel ring is flushed to make room).
 * Ownership: gradient and out must stay valid, and gradient unchanged, until
 * the request is done (ember_wait returned something other than
 * EMBER_PENDING); freeing the request early does not cancel the operation.
 * Errors found before anything is sent (NULL worker or out_request, NULL
 * buffer) are returned here, and then *out_request is not set; every other
 * error (unknown key, wrong size, the server's reply) is returned by
 * ember_wait. */
EMBER_API int ember_push_async(ember_worker* worker, uint64_t key, const float* gradient,
                               size_t num_elements, ember_request** out_request);
EMBER_API int ember_pull_async(ember_worker* worker, uint64_t key, float* out,
                               size_t num_elements, ember_request** out_request);
EMBER_API int ember_push_pull_async(ember_worker* worker, uint64_t key, const float* gradient,
                                    float* out, size_t num_elements, ember_request** out_request);

/* Every worker of the job reaches the barrier before any returns. Blocks.
 * out_generation: the barrier's sequence number (0, 1, ...).
 * Errors: EMBER_E_INVALID_ARGUMENT (worker NULL; 16 barriers of this worker
 * waiting already; a re-sent barrier older than the answers server 0 keeps),
 * EMBER_E_WORKER_LOST, EMBER_E_CANCELLED (it came on a connection that a newer
 * join of this rank replaced), EMBER_E_CLOSED, EMBER_E_TIMEOUT, and the
 * reconnect errors of ember_init. */
EMBER_API int ember_barrier(ember_worker* worker, uint64_t* out_generation);

/* Sets the optimizer's learning rate on every server (applied before the
 * reply). Blocks until every server has answered.
 * Errors: EMBER_E_INVALID_ARGUMENT (worker NULL, learning_rate <= 0, NaN or
 * infinite), EMBER_E_CLOSED, EMBER_E_TIMEOUT, and the reconnect errors of
 * ember_init. */
EMBER_API int ember_set_learning_rate(ember_worker* worker, double learning_rate);

/* Every server writes a checkpoint now. Blocks until written.
 * out_sequence: each server numbers its own checkpoints; this is the
 * smallest of the sequence numbers the servers wrote this time.
 * Errors: EMBER_E_INVALID_ARGUMENT (worker NULL), EMBER_E_CONFIG (a server
 * has no [server] checkpoint_dir), EMBER_E_IO (the write failed),
 * EMBER_E_TOO_LARGE (a server's checkpoint numbering is at 2^53),
 * EMBER_E_CANCELLED (a server shut down first), EMBER_E_CLOSED,
 * EMBER_E_TIMEOUT, and the reconnect errors of ember_init. */
EMBER_API int ember_checkpoint(ember_worker* worker, uint64_t* out_sequence);

/* ------------------------------------------------------------------------
 * Requests.
 */

/* Waits until `request` is done or timeout_ms milliseconds have passed
 * (0: just look; EMBER_WAIT_FOREVER: until done, which "Blocking" above
 * bounds). Returns EMBER_PENDING when still running (wait
 * again later), EMBER_OK with *out_step (the operation's step: see
 * ember_push / ember_pull) when it succeeded, or the operation's error code
 * (with its message in ember_last_error). Waiting again on a done request
 * returns the same result. Blocks up to timeout_ms; from a year on
 * (INT64_MAX included) that is until done, as with EMBER_WAIT_FOREVER.
 * Several threads may wait on one request at once.
 * Errors: EMBER_E_INVALID_ARGUMENT (request NULL, timeout_ms < -1), and the
 * operation's errors as listed with the function that started it. */
EMBER_API int ember_wait(ember_request* request, int64_t timeout_ms, uint64_t* out_step);

/* Frees a request handle. Does not cancel or wait for the operation (its
 * buffers must stay valid until it is done). Valid after ember_worker_destroy.
 * NULL is a no-op. Does not change the last error. */
EMBER_API void ember_request_free(ember_request* request);

/* ------------------------------------------------------------------------
 * Pipelines: many small tensors batched together. Enqueued operations are
 * only queued; ember_pipeline_flush (or _wait, or _destroy) sends them, and
 * the transport packs small ones into shared batches.
 */

/* Opens a pipeline on `worker`. Never blocks.
 * Ownership: *out_pipeline (required) is freed with ember_pipeline_destroy,
 * or by ember_worker_destroy.
 * Errors: EMBER_E_INVALID_ARGUMENT (NULL arguments). */
EMBER_API int ember_pipeline_create(ember_worker* worker, ember_pipeline** out_pipeline);

/* Queue a push / pull / push_pull (meaning, ownership of the buffers and
 * errors as with ember_push_async and friends). out_request may be NULL:
 * the result is then only seen through ember_pipeline_wait. They send only
 * when the channel's ring is full (that channel is flushed), or when the
 * key's previous pipelined request came from another thread (the key's
 * rings are flushed first, to keep its steps in order); they may wait as
 * "Blocking" says. */
EMBER_API int ember_pipeline_push(ember_pipeline* pipeline, uint64_t key, const float* gradient,
                                  size_t num_elements, ember_request** out_request);
EMBER_API int ember_pipeline_pull(ember_pipeline* pipeline, uint64_t key, float* out,
                                  size_t num_elements, ember_request** out_request);
EMBER_API int ember_pipeline_push_pull(ember_pipeline* pipeline, uint64_t key,
                                       const float* gradient, float* out, size_t num_elements,
                                       ember_request** out_request);

/* Sends everything queued so far in the worker's channel rings, including
 * what other pipelines of this worker queued. Does not wait for replies, but
 * may wait for room or a reconnect as "Blocking" above says.
 * Errors: EMBER_E_INVALID_ARGUMENT (pipeline NULL), the first send error
 * (EMBER_E_CLOSED, EMBER_E_IO, ...; that operation's request has it too). */
EMBER_API int ember_pipeline_flush(ember_pipeline* pipeline);

/* Flushes, then waits for every operation enqueued since the last
 * ember_pipeline_wait. Blocks (each operation bounded as "Blocking" says).
 * Errors: EMBER_E_INVALID_ARGUMENT (pipeline NULL), else the first error of
 * the operations (all are waited for). */
EMBER_API int ember_pipeline_wait(ember_pipeline* pipeline);

/* Flushes what is queued (without waiting) and frees the pipeline. Requests
 * obtained from it stay valid. NULL is a no-op. Pre: no other thread uses
 * the pipeline. Does not change the last error. */
EMBER_API void ember_pipeline_destroy(ember_pipeline* pipeline);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* EMBER_CAPI_EMBER_H_ */
