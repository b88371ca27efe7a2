"""ember.Worker: the Python face of the Ember worker (over libember.so).

Tensors are float32 numpy arrays in C order. Gradients may be any array-like
(converted with numpy.ascontiguousarray(dtype=float32), which copies only
when the input is not already that); pull destinations (`out`) must be
C-contiguous, writeable float32 arrays, because the parameters land in them.
Shapes: once a key is init-ed here, a gradient or `out` must have the key's
shape, be flat (0-D or 1-D) with its element count, or differ from it only
in size-1 dimensions; another shape of the same count (a transposed
tensor) is EmberError E_SHAPE_MISMATCH.

Zero copy. Worker.allocate() returns a numpy array that *is* a page-pool
buffer of the worker (array.ctypes.data == the pool address): a gradient
written into it leaves from there without a copy. The buffer is freed when
the last array (or view) on it is gone; it keeps the worker's native handle
alive until then.

Lifetime. Worker.close() (or leaving `with Worker(...)`) waits for every
operation still running, then closes the connections. When arrays from
allocate() are still alive, the native worker (and its connections) is kept
until the last of them is gone, because their memory belongs to it; the
Worker object itself refuses further calls. At interpreter exit every
worker still open is closed.

Asynchrony. push_async / pull_async / push_pull_async and pipeline().enqueue
return a Future. The arrays an operation reads or writes are kept alive by
the worker until the operation is done, whether or not the Future is kept.
A gradient is read when it is sent, not when it is enqueued: leave it
unchanged until the Future is done. Requests cannot be withdrawn: leaving a
`with w.pipeline()` block by an exception still sends what was enqueued.
Future.result() is interrupted by Ctrl-C at once; the blocking calls (push,
pull, push_pull, barrier) return to Python, and so to signal handlers, only
when their operation ends (at most [worker] request_timeout).

Processes. A Worker belongs to the process that created it: in a child made
by fork() it is closed (EmberError E_CLOSED saying so; exiting the child is
fine). Create workers in the child, or use multiprocessing's 'spawn' start
method. Arrays from allocate() are shared memory: a forked child that writes
into them writes into the parent's.

Errors are EmberError (code, name, message: Ember's text naming the cause
and what to do). Bad Python arguments (a negative key, an `out` of the wrong
dtype) are ValueError / TypeError before anything reaches the library.

Thread-safety: every Worker, Pipeline and Future method may be called from
several threads at once, except close(). Blocking calls release the GIL.
"""

import atexit
import ctypes
import math
import os
import threading
import time
import weakref

import numpy as np

from . import _native
from ._native import lib

__all__ = ["EmberError", "Worker", "Pipeline", "Future", "set_log_level", "version"]

_U64_MAX = (1 << 64) - 1
_SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1


class EmberError(Exception):
    """An error reported by Ember.

    code:    the EMBER_E_* number (ember.E_NOT_FOUND, ...), equal to ember::ErrorCode
    name:    its short name ("not_found", "timeout", ...)
    message: Ember's message, "<name>: <what failed and what to do>"
    """

    def __init__(self, code, message):
        self.code = int(code)
        self.name = _native.error_name(code)
        self.message = message or self.name
        super().__init__(self.message)


def _check(rc):
    """Raises EmberError for a failed call (reads this thread's last error)."""
    if rc != _native.OK:
        raise EmberError(rc, _native.last_error())


def _closed_error():
    return EmberError(_native.E_CLOSED, "closed: this ember.Worker is closed")


def _forked_error(pid):
    return EmberError(_native.E_CLOSED,
                      "closed: this ember.Worker belongs to process %d, and this is a forked "
                      "child (process %d): the worker's connections and I/O threads stayed with "
                      "the parent. Create a new Worker in the child (multiprocessing: use the "
                      "'spawn' or 'forkserver' start method, or create it inside the target)"
                      % (pid, os.getpid()))


def version():
    """The loaded library's version string, e.g. "0.1.0"."""
    return lib.ember_version().decode()


def set_log_level(level):
    """Level of Ember's log lines on stderr: "trace" .. "critical", "off".
    Until set, the first Worker sets "warn"."""
    _check(lib.ember_set_log_level(str(level).encode()))


_YEAR_S = 365 * 24 * 3600.0  # ember_wait waits until done from a year on
_WAIT_SLICE_MS = 100  # Future.result waits this long at a time (signals run between)


def _key(key):
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
        raise TypeError("key must be an int, got %r" % (key,))
    key = int(key)
    if not 0 <= key <= _U64_MAX:
        raise ValueError("key must be in 0 .. 2**64-1, got %d" % key)
    return key


def _c_text(value, what):
    """`value` (str, or bytes as UTF-8) as a C string; a NUL inside would cut
    it short without a word, so it is refused."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode()
        except UnicodeDecodeError as e:
            raise ValueError("%s must be UTF-8 text (the C ABI takes UTF-8), got %r: %s"
                             % (what, bytes(value), e)) from None
    elif not isinstance(value, str):
        raise TypeError("%s must be a str, got %s" % (what, type(value).__name__))
    if "\0" in value:
        raise ValueError("%s holds a NUL character: %r" % (what, value))
    return value.encode()


def _dim(d, shape):
    """One dimension as an int: integral values only (int() would cut 2.9 to
    2 without a word)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        raise TypeError("shape dimensions must be ints, got %r in %r" % (d, shape))
    return int(d)


def _shape(shape):
    """A shape as a tuple of ints, each in 0 .. 2**64-1 (ctypes would wrap
    larger ones silently); the C ABI checks the product."""
    shape = (_dim(shape, shape),) if np.isscalar(shape) else tuple(_dim(d, shape) for d in shape)
    for d in shape:
        if not 0 <= d <= _U64_MAX:
            raise ValueError("shape dimensions must be in 0 .. 2**64-1, got %r" % (shape,))
    return shape


def _check_shape(shapes, key, arr, what):
    """Refuses an array whose shape differs from the key's (as init-ed here)
    while its element count matches: a transposed or reshaped tensor would
    otherwise travel as if it were the key's. A flat (1-D) array of the
    right size is accepted, and so is a shape that differs only in size-1
    dimensions. Counts that differ are the C ABI's to refuse."""
    known = shapes.get(key)
    if known is None or arr.shape == known or arr.ndim <= 1:
        return
    # Size-1 dimensions added or dropped ((1, n) for (n,), keepdims sums)
    # leave the layout as it is.
    if tuple(d for d in arr.shape if d != 1) == tuple(d for d in known if d != 1):
        return
    if arr.size == math.prod(known):
        raise EmberError(_native.E_SHAPE_MISMATCH,
                         "shape_mismatch: %s of key %d has shape %s but the key was init-ed with "
                         "shape %s; pass an array of that shape (or a flat one of %d elements)"
                         % (what, key, arr.shape, known, arr.size))


def _as_input(values, what="gradient"):
    # No copy when `values` is already a C-contiguous float32 array.
    if values is None:
        raise TypeError("%s must be an array of float32 values (or convertible to one), "
                        "got None" % what)
    return np.ascontiguousarray(values, dtype=np.float32)


def _as_output(out, what="out"):
    if not isinstance(out, np.ndarray):
        raise TypeError("%s must be a numpy array, got %s" % (what, type(out).__name__))
    if out.dtype != np.float32:
        raise TypeError("%s must have dtype float32, got %s" % (what, out.dtype))
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("%s must be C-contiguous and writeable (parameters are written "
                         "into it)" % what)
    return out


def _addr(arr):
    return arr.__array_interface__["data"][0]


class _Native:
    """The native worker handle and everything that must outlive Python
    objects referring to it: live pool buffers and running operations."""

    def __init__(self, handle):
        self.handle = handle
        self.lock = threading.RLock()  # RLock: finalizers may run inside
        self.live_buffers = 0
        self.closing = False
        self.destroyed = False
        self.pending = {}  # id(Future) -> Future, until done
        self.pid = os.getpid()
        self.forked = False  # this is a forked child's copy: never call the library

    def check_open(self):
        if self.forked:
            raise _forked_error(self.pid)
        if self.closing or self.destroyed:
            raise _closed_error()

    # -- buffers
    def buffer_created(self):
        with self.lock:
            self.live_buffers += 1

    def buffer_released(self, address):
        with self.lock:
            if not self.destroyed:
                lib.ember_free(self.handle, address)
            self.live_buffers -= 1
            self._destroy_if_done()

    # -- operations
    def add_pending(self, fut):
        with self.lock:
            self.pending[id(fut)] = fut
            if len(self.pending) > 4096:  # futures nobody waits on: drop the done ones
                for f in list(self.pending.values()):
                    f.done()

    def remove_pending(self, fut):
        with self.lock:
            self.pending.pop(id(fut), None)

    def wait_pending(self):
        while True:
            with self.lock:
                futures = list(self.pending.values())
            if not futures:
                return
            for f in futures:
                f._wait_quietly()

    # -- closing
    def close(self):
        if self.forked:
            return  # the parent's worker: nothing of it is this process's to close
        self.wait_pending()
        with self.lock:
            self.closing = True
            self._destroy_if_done()

    def _destroy_if_done(self):
        if self.closing and self.live_buffers == 0 and not self.destroyed:
            self.destroyed = True
            lib.ember_worker_destroy(self.handle)

    def destroy_now(self):
        """At interpreter exit: close regardless of live arrays."""
        with self.lock:
            self.closing = True
            if not self.destroyed:
                self.destroyed = True
                lib.ember_worker_destroy(self.handle)


_live_natives = weakref.WeakSet()


@atexit.register
def _close_all_at_exit():
    for native in list(_live_natives):
        native.destroy_now()


def _after_fork_in_child():
    # A forked child has the parent's handles but none of its I/O threads:
    # any call into the library would wait forever (a destroy at exit
    # included) or send on the parent's connections as the parent's rank.
    # Every worker becomes unusable here, with an error that says why.
    for native in list(_live_natives):
        native.forked = True
        native.destroyed = True  # no ember_free / ember_worker_destroy either
        native.closing = True
        native.lock = threading.RLock()  # another thread may have held it at the fork
        native.pending = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _BufferOwner:
    """Frees one pool buffer when the last numpy view of it is gone."""

    __slots__ = ("native", "address", "__weakref__")

    def __init__(self, native, address):
        self.native = native
        self.address = address
        native.buffer_created()

    def __del__(self):
        self.native.buffer_released(self.address)


class Future:
    """The result of one asynchronous operation.

    result(timeout=None) blocks until done (timeout in seconds; None: until
    done, bounded by the config's [worker] request_timeout) and returns the
    operation's value (a pull's `out` array, a push's step), or raises
    EmberError, or TimeoutError when `timeout` passed first (the operation
    keeps running). It waits in slices of 100 ms, so Ctrl-C (KeyboardInterrupt)
    interrupts it at once; the operation keeps running. done() never blocks.
    step is the operation's step once done (see Worker.push / Worker.pull).
    """

    def __init__(self, native, request, value, keep, flush=None):
        self._native = native
        self._request = request  # ctypes.c_void_p owned by this Future until done
        self._value = value  # what result() returns; None: the step
        self._flush = flush  # a pipeline's flush: queued operations are sent first
        self._keep = keep  # arrays the operation uses, alive until done
        self._lock = threading.Lock()
        self._finished = False
        self._waiters = 0  # threads inside ember_wait on _request
        self._error = None
        self._step = None
        native.add_pending(self)

    def _poll(self, timeout_ms):
        """Waits up to timeout_ms (-1: until done); True when done. Several
        threads may wait at once: the native request is freed by the last
        one to leave ember_wait after it finished, never under another."""
        if self._native.forked and not self._finished:
            raise _forked_error(self._native.pid)
        with self._lock:
            finished = self._finished
            if not finished:
                req = self._request
                self._waiters += 1
        if finished:
            self._native.remove_pending(self)  # (idempotent)
            return True
        step = ctypes.c_uint64(0)
        rc = _native.PENDING  # if the wait itself raises (KeyboardInterrupt)
        try:
            rc = lib.ember_wait(req, timeout_ms, ctypes.byref(step))
        finally:
            # (Here, not in the try: an interrupt after ember_wait returned
            # must still record the operation's error.)
            error = None
            if rc not in (_native.PENDING, _native.OK):
                error = EmberError(rc, _native.last_error())
            with self._lock:
                self._waiters -= 1
                if rc != _native.PENDING and not self._finished:
                    self._finished = True
                    self._error = error
                    self._step = step.value if rc == _native.OK else None
                    self._keep = None
                if self._finished and self._waiters == 0 and self._request is not None:
                    lib.ember_request_free(self._request)
                    self._request = None
        if rc == _native.PENDING:
            return False
        self._native.remove_pending(self)
        return True

    def done(self):
        return self._poll(0)

    def result(self, timeout=None):
        if self._flush is not None and not self._poll(0):
            self._flush()  # a queued pipeline operation would never finish unsent
        if timeout is not None and timeout != timeout:
            raise ValueError("timeout must be a number of seconds or None, got nan")
        # Waits in slices, so that Python runs its signal handlers (Ctrl-C:
        # KeyboardInterrupt) between them instead of after request_timeout.
        if timeout is None or timeout >= _YEAR_S:
            # (from a year on, inf included: until done, as ember_wait does)
            while not self._poll(_WAIT_SLICE_MS):
                pass
        else:
            deadline = time.monotonic() + max(0.0, timeout)
            while not self._poll(max(0, min(_WAIT_SLICE_MS,
                                            int((deadline - time.monotonic()) * 1000)))):
                if time.monotonic() >= deadline:
                    raise TimeoutError("ember operation still running after %.3f s" % timeout)
        if self._error is not None:
            raise self._error
        return self._step if self._value is None else self._value

    def exception(self, timeout=None):
        try:
            self.result(timeout)
        except EmberError as e:
            return e
        return None

    @property
    def step(self):
        return self._step

    def _wait_quietly(self):
        try:
            self.result()
        except EmberError:
            pass


class Pipeline:
    """A batching scope (from Worker.pipeline()): enqueue many operations,
    they are sent together (small ones packed into shared batches) on flush(),
    wait() or when the `with` block ends, which waits for all of them and
    raises the first error (unless the block itself raised).

        with worker.pipeline() as p:
            futures = [p.enqueue(k, g, out=params[k]) for k, g in grads.items()]
        # every push_pull is done here
    """

    def __init__(self, worker):
        self._native = worker._native
        self._worker = worker
        handle = ctypes.c_void_p()
        with self._native.lock:
            self._native.check_open()
            _check(lib.ember_pipeline_create(self._native.handle, ctypes.byref(handle)))
        self._handle = handle
        self._lock = threading.Lock()
        self._futures = []
        self._closed = False

    def enqueue(self, key, gradient, out=None):
        """Queues a push of `gradient` (out None) or a push_pull into `out`.
        Returns a Future (its value: `out`, or the step for a push). Sends
        only when a channel's ring is full, or when the key's previous
        pipelined request came from another thread (to keep its steps in
        order). TypeError for a gradient of None."""
        key = _key(key)
        g = self._worker._gradient(key, gradient)
        if out is None:
            return self._enqueue(lib.ember_pipeline_push, key, (g,), None, (_addr(g), g.size))
        o = _as_output(out)
        _check_shape(self._worker._shapes, key, o, "out")
        return self._enqueue(lib.ember_pipeline_push_pull, key, (g, o), o,
                             (_addr(g), _addr(o), o.size))

    def enqueue_pull(self, key, out):
        """Queues a pull into `out`. Returns a Future whose value is `out`."""
        key = _key(key)
        o = _as_output(out)
        _check_shape(self._worker._shapes, key, o, "out")
        return self._enqueue(lib.ember_pipeline_pull, key, (o,), o, (_addr(o), o.size))

    def _enqueue(self, fn, key, keep, value, args):
        if self._closed:
            raise _closed_error()
        self._native.check_open()
        req = ctypes.c_void_p()
        _check(fn(self._handle, key, *args, ctypes.byref(req)))
        fut = Future(self._native, req, value, keep, flush=self.flush)
        with self._lock:
            self._futures.append(fut)
        return fut

    def flush(self):
        """Sends everything queued; does not wait. A no-op once closed (closing
        flushed everything)."""
        if self._closed:
            return
        with self._native.lock:
            if self._native.destroyed:
                return
            _check(lib.ember_pipeline_flush(self._handle))

    def wait(self):
        """Flushes and waits for every operation enqueued since the last
        wait; raises the first error (EmberError E_CLOSED once the pipeline
        is closed, or once its worker's native handle is gone: closing the
        worker ended its operations; while pool arrays keep that handle,
        waiting still works and finds them done)."""
        with self._native.lock:
            if self._closed or self._native.destroyed:
                raise _closed_error()
        rc = lib.ember_pipeline_wait(self._handle)
        error = None if rc == _native.OK else EmberError(rc, _native.last_error())
        with self._lock:
            futures, self._futures = self._futures, []
        for f in futures:
            f._wait_quietly()  # done already: collects each result
        if error is not None:
            raise error

    def close(self):
        if self._closed:
            return
        if self._native.destroyed:  # the worker closed it (and its operations)
            self._closed = True
            return
        try:
            self.wait()
        finally:
            self._closed = True
            with self._native.lock:
                if not self._native.destroyed:
                    lib.ember_pipeline_destroy(self._handle)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except EmberError:
                pass  # the block's own exception is the one to see
        return False


class Worker:
    """A worker of an Ember job.

    Worker(config_path, rank=None, overrides=()) loads the job's TOML config
    (the servers' file), applies `overrides` ("table.key=value" strings),
    sets [worker] rank when `rank` is given, connects to every server and
    joins. Blocks while connecting (retrying per [worker] connect_retries).
    Raises EmberError: E_CONFIG (missing or invalid file, bad override, rank
    >= [cluster] num_workers, a server with another [cluster] table, two
    servers whose consistency or [optimizer] settings differ), E_IO /
    E_TIMEOUT (a server unreachable), E_AUTH / E_VERSION_MISMATCH /
    E_PROTOCOL (the handshake refused), E_UNAVAILABLE (transport "rdma"
    without an RDMA port; a pool_backing this host cannot give),
    E_INVALID_ARGUMENT (rank above 2**32 - 1). Raises ValueError for a
    negative or non-int rank and TypeError for overrides given as one string
    (see ember_worker_create in capi/ember.h for the full list).
    """

    def __init__(self, config_path, rank=None, overrides=()):
        if rank is None:
            c_rank = _native.RANK_FROM_CONFIG
        else:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
                raise ValueError("rank must be a non-negative int or None, got %r" % (rank,))
            c_rank = int(rank)
        if isinstance(overrides, (str, bytes, bytearray)):
            # A lone string would be taken one character at a time.
            raise TypeError("overrides must be a list of \"table.key=value\" strings, got the "
                            "string %r; write [%r]" % (overrides, overrides))
        sets = [_c_text(s, "override") for s in overrides]
        c_sets = (ctypes.c_char_p * max(1, len(sets)))(*sets)
        handle = ctypes.c_void_p()
        _check(lib.ember_worker_create(_c_text(os.fspath(config_path), "config_path"), c_rank,
                                       c_sets, len(sets), ctypes.byref(handle)))
        self._native = _Native(handle)
        _live_natives.add(self._native)
        self._shapes = {}
        r, w, s = ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_uint32()
        _check(lib.ember_worker_info(handle, ctypes.byref(r), ctypes.byref(w), ctypes.byref(s)))
        self.rank, self.num_workers, self.num_servers = r.value, w.value, s.value

    # -- lifetime
    def close(self):
        """Waits for running operations, then closes (see the module doc)."""
        native = getattr(self, "_native", None)
        if native is not None and not native.closing:
            native.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def __del__(self):
        self.close()

    @property
    def closed(self):
        return self._native.closing

    def _h(self):
        self._native.check_open()
        return self._native.handle

    # -- memory
    def allocate(self, shape, dtype=np.float32):
        """A zeroed numpy array of `shape` and `dtype` whose memory is a pool
        buffer of this worker (a zero-copy view; 4 KiB aligned). Arrays the
        pool cannot hold ([communication] prealloc_pages) get heap memory
        instead (is_pool_buffer() tells). Never blocks."""
        dtype = np.dtype(dtype)
        shape = _shape(shape)
        count = math.prod(shape)  # exact: numpy's int64 product wraps
        nbytes = max(1, count * dtype.itemsize)
        if nbytes > _SIZE_MAX:
            raise EmberError(_native.E_TOO_LARGE,
                             "too_large: an array of shape %s and dtype %s needs %d bytes, more "
                             "than the address space" % (shape, dtype, nbytes))
        addr = ctypes.c_void_p()
        with self._native.lock:
            _check(lib.ember_alloc(self._h(), nbytes, ctypes.byref(addr)))
            owner = _BufferOwner(self._native, addr.value)
        raw = (ctypes.c_byte * nbytes).from_address(addr.value)
        raw._ember_owner = owner  # the views keep raw, raw keeps the owner
        arr = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
        arr.fill(0)
        return arr

    def buffer_info(self, array):
        """(nbytes, in_pool) of the buffer `array` starts at: an array (not
        an offset view) from allocate(). Raises EmberError E_NOT_FOUND for
        other memory."""
        size, in_pool = ctypes.c_size_t(), ctypes.c_int()
        _check(lib.ember_buffer_info(self._h(), _addr(array), ctypes.byref(size),
                                     ctypes.byref(in_pool)))
        return size.value, bool(in_pool.value)

    def is_pool_buffer(self, array):
        """True when `array` starts at a page-pool buffer of this worker."""
        try:
            return self.buffer_info(array)[1]
        except EmberError:
            return False

    # -- tensors
    def init(self, key, shape=None, values=None):
        """Registers `key` as a float32 tensor of `shape` (tuple or int;
        default: values' shape). Rank 0 passes the initial `values`; other
        ranks pass none and wait until rank 0 has registered it. Returns the
        step to compute next (0 for a fresh job). Blocks. Raises EmberError
        E_TOO_LARGE for a tensor larger than this host's memory (every rank
        pulls all of it), E_SHAPE_MISMATCH when the key has another shape.

        A worker restarted with the same rank (rejoin) gets the job's step
        per key; keys it pushed before it died are one step ahead. Resume at
        the smallest step s, and in step s pull rather than push the keys
        whose step(key) is already s + 1, or every worker waits until
        request_timeout (docs/troubleshooting.md#worker-loss)."""
        key = _key(key)
        v = None if values is None else _as_input(values)
        if shape is None:
            if v is None:
                raise ValueError("init needs a shape or values")
            shape = v.shape
        shape = _shape(shape)
        dims = (ctypes.c_uint64 * max(1, len(shape)))(*shape)
        step = ctypes.c_uint64()
        _check(lib.ember_init(self._h(), key, dims, len(shape),
                              None if v is None else _addr(v), 0 if v is None else v.size,
                              ctypes.byref(step)))
        self._shapes[key] = shape
        return step.value

    def _out_for(self, key, out):
        if out is not None:
            o = _as_output(out)
            _check_shape(self._shapes, key, o, "out")
            return o
        shape = self._shapes.get(key)
        if shape is None:
            raise EmberError(_native.E_NOT_FOUND,
                             "not_found: key %d was not init-ed by this worker; call "
                             "init(key, shape, values) first (or pass out=)" % key)
        return np.empty(shape, dtype=np.float32)

    def push(self, key, gradient):
        """Sends this step's gradient of `key`; returns the step pushed. Blocks
        until the servers accepted it.

        `gradient`: array-like of the key's shape or a flat one of its size,
        converted to C-contiguous float32 (no copy when it already is one).
        Raises EmberError: E_SHAPE_MISMATCH (another shape of the same
        size), E_INVALID_ARGUMENT (another size; or more than 64 steps past
        the open round), E_NOT_FOUND (key not init-ed), E_STALE (bsp: the
        round is over), E_OUT_OF_STEP (see step()), E_CLOSED / E_TIMEOUT /
        E_IO (server lost or unreachable); ember_push in capi/ember.h lists
        them all."""
        key = _key(key)
        g = self._gradient(key, gradient)
        step = ctypes.c_uint64()
        _check(lib.ember_push(self._h(), key, _addr(g), g.size, ctypes.byref(step)))
        return step.value

    def pull(self, key, out=None):
        """Parameters of `key` that include every push this worker made (bsp:
        every worker's pushes of those steps), written into `out` (a new
        array of the key's shape when None); returns `out`. Blocks.

        Raises TypeError / ValueError for an `out` that is not a writable
        C-contiguous float32 array of the key's size, and EmberError:
        E_NOT_FOUND, E_WORKER_LOST (a worker the step needs is gone, per
        on_worker_loss), E_OUT_OF_STEP (see step()), E_CLOSED / E_TIMEOUT /
        E_IO; ember_pull in capi/ember.h lists them all."""
        key = _key(key)
        o = self._out_for(key, out)
        _check(lib.ember_pull(self._h(), key, _addr(o), o.size, None))
        return o

    def push_pull(self, key, gradient, out=None):
        """push then pull in one round trip; returns `out`. `out` may be the
        gradient's own array. Blocks. Raises what push and pull raise."""
        key = _key(key)
        g = self._gradient(key, gradient)
        o = self._out_for(key, out)
        _check(lib.ember_push_pull(self._h(), key, _addr(g), _addr(o), o.size, None))
        return o

    def push_async(self, key, gradient):
        """Starts a push; the Future's value is the step pushed."""
        key = _key(key)
        g = self._gradient(key, gradient)
        return self._start(lib.ember_push_async, key, (g,), None, (_addr(g), g.size))

    def pull_async(self, key, out=None):
        """Starts a pull; the Future's value is `out`."""
        key = _key(key)
        o = self._out_for(key, out)
        return self._start(lib.ember_pull_async, key, (o,), o, (_addr(o), o.size))

    def push_pull_async(self, key, gradient, out=None):
        """Starts a push_pull; the Future's value is `out`."""
        key = _key(key)
        g = self._gradient(key, gradient)
        o = self._out_for(key, out)
        return self._start(lib.ember_push_pull_async, key, (g, o), o,
                           (_addr(g), _addr(o), o.size))

    def _gradient(self, key, gradient):
        g = _as_input(gradient)
        _check_shape(self._shapes, key, g, "gradient")
        return g

    def _start(self, fn, key, keep, value, args):
        req = ctypes.c_void_p()
        _check(fn(self._h(), key, *args, ctypes.byref(req)))
        return Future(self._native, req, value, keep)

    def barrier(self):
        """Every worker reaches it before any returns; returns its sequence number.
        Blocks. Raises EmberError: E_WORKER_LOST, E_CLOSED, E_TIMEOUT."""
        gen = ctypes.c_uint64()
        _check(lib.ember_barrier(self._h(), ctypes.byref(gen)))
        return gen.value

    def set_learning_rate(self, learning_rate):
        """The optimizer's learning rate on every server (> 0, finite). Blocks.
        Raises EmberError: E_INVALID_ARGUMENT (not > 0 or not finite),
        E_CLOSED, E_TIMEOUT."""
        _check(lib.ember_set_learning_rate(self._h(), float(learning_rate)))

    def checkpoint(self):
        """Every server writes a checkpoint now; returns the smallest of the
        servers' sequence numbers (each server numbers its own). Blocks.
        Raises EmberError: E_CONFIG (a server has no checkpoint_dir), E_IO
        (the write failed; the message says what to do), E_CLOSED, E_TIMEOUT."""
        seq = ctypes.c_uint64()
        _check(lib.ember_checkpoint(self._h(), ctypes.byref(seq)))
        return seq.value

    def step(self, key):
        """The step the next push of `key` will use (0 if not init-ed).

        After an EmberError with code E_OUT_OF_STEP (a server restored from an
        older checkpoint refused the step), the step that server expects:
        pull(key) at it and continue from there. (Not after a pull that
        overtook this worker's own unanswered pushes of the key: the error
        says so, and the step stays.)"""
        s = ctypes.c_uint64()
        _check(lib.ember_step(self._h(), _key(key), ctypes.byref(s)))
        return s.value

    def pipeline(self):
        """A Pipeline (use it as a context manager)."""
        return Pipeline(self)

    def __repr__(self):
        state = "closed" if self._native.closing else "open"
        return "<ember.Worker rank %d of %d, %d server(s), %s>" % (
            self.rank, self.num_workers, self.num_servers, state)
