"""Round trips through a real ember-server: zero-copy pool arrays, init /
push / pull / push_pull, async futures, barrier, learning rate, and two
workers under BSP."""

import threading

import numpy as np
import pytest

import ember


def test_allocate_is_a_zero_copy_view_of_a_pool_buffer(server):
    with ember.Worker(server.config_path, rank=0) as w:
        a = w.allocate((3, 5))
        assert a.shape == (3, 5) and a.dtype == np.float32
        assert a.flags.c_contiguous and a.flags.writeable
        assert not a.any()
        nbytes, in_pool = w.buffer_info(a)
        assert nbytes == 3 * 5 * 4
        assert in_pool
        assert w.is_pool_buffer(a)
        assert a.ctypes.data % 4096 == 0
        # The same memory, not a copy: a write through a ctypes pointer at
        # the pool address shows in the array.
        import ctypes
        ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float))[7] = 42.0
        assert a.reshape(-1)[7] == 42.0
        b = w.allocate(10, dtype=np.float64)
        assert b.shape == (10,) and b.dtype == np.float64
        assert w.buffer_info(b) == (80, True)
        assert not w.is_pool_buffer(np.zeros(4, np.float32))


def test_pool_arrays_outlive_close_and_free_on_release(server):
    w = ember.Worker(server.config_path, rank=0)
    a = w.allocate(16)
    view = a[4:8]
    w.close()
    assert w.closed
    view[:] = 3.0  # the memory is still the worker's, kept alive by the view
    assert a[5] == 3.0
    native = w._native
    assert not native.destroyed
    del a
    assert not native.destroyed  # `view` still refers to the buffer
    del view
    assert native.destroyed  # last view gone: buffer freed, worker destroyed


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_round_trip_push_pull_barrier_learning_rate(start_server, transport):
    server = start_server(learning_rate=0.5, transport=transport)
    with ember.Worker(server.config_path, rank=0) as w:
        assert (w.rank, w.num_workers, w.num_servers) == (0, 1, 1)
        params = w.allocate((2, 3))
        params[:] = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
        assert w.init(7, values=params) == 0
        assert w.step(7) == 0
        grad = w.allocate((2, 3))
        grad[:] = 1.0
        assert w.push(7, grad) == 0
        assert w.step(7) == 1
        out = w.pull(7, out=params)
        assert out is params
        np.testing.assert_allclose(params, np.arange(1, 7).reshape(2, 3) - 0.5)
        fresh = w.pull(7)  # a new array of the key's shape
        assert fresh.shape == (2, 3)
        np.testing.assert_array_equal(fresh, params)
        w.push_pull(7, grad, out=params)
        np.testing.assert_allclose(params, np.arange(1, 7).reshape(2, 3) - 1.0)
        assert w.barrier() == 0
        assert w.barrier() == 1
        w.set_learning_rate(0.25)
        w.push_pull(7, [[1, 1, 1], [1, 1, 1]], out=params)  # lists are converted
        np.testing.assert_allclose(params, np.arange(1, 7).reshape(2, 3) - 1.25)


def test_async_futures(server):
    with ember.Worker(server.config_path, rank=0) as w:
        w.init(1, values=np.zeros(1000, np.float32))
        w.init(2, values=np.ones(10, np.float32))
        g1 = np.full(1000, 2.0, np.float32)
        out1 = np.empty(1000, np.float32)
        f1 = w.push_pull_async(1, g1, out=out1)
        f2 = w.push_async(2, np.ones(10, np.float32))
        assert f2.result(timeout=20) == 0  # a push's value is its step
        assert f2.done()
        assert f1.result() is out1
        assert f1.step == 1
        np.testing.assert_allclose(out1, np.full(1000, -1.0))
        f3 = w.pull_async(2)
        np.testing.assert_allclose(f3.result(), np.full(10, 0.5))


def test_two_workers_bsp_average_and_pending(start_server):
    s = start_server(num_workers=2, learning_rate=0.5)
    workers = [None, None]

    def make(r):
        workers[r] = ember.Worker(s.config_path, rank=r)

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join()
    w0, w1 = workers
    try:
        init = np.array([1, 2, 3], np.float32)
        t = threading.Thread(target=w1.init, args=(5, (3,)))
        t.start()
        w0.init(5, values=init)
        t.join()
        p0, p1 = np.empty(3, np.float32), np.empty(3, np.float32)
        f0 = w0.push_pull_async(5, np.ones(3), out=p0)
        # Step 1 needs rank 1's push of step 0: not yet.
        with pytest.raises(TimeoutError):
            f0.result(timeout=0.02)
        assert not f0.done()
        w1.push_pull(5, np.full(3, 3.0), out=p1)
        f0.result()
        np.testing.assert_allclose(p0, init - 0.5 * 2.0)  # mean of 1 and 3
        np.testing.assert_array_equal(p0, p1)
    finally:
        w0.close()
        w1.close()


def test_threads_share_one_worker(server):
    # Calls release the GIL and the C ABI is thread-safe: four threads, each
    # with its own key, push_pull concurrently through one worker.
    with ember.Worker(server.config_path, rank=0) as w:
        for k in range(4):
            w.init(10 + k, values=np.full(64, float(k), np.float32))
        errors = []

        def run(k):
            try:
                out = w.allocate(64)
                for _ in range(20):
                    w.push_pull(10 + k, np.full(64, 0.1, np.float32), out=out)
                np.testing.assert_allclose(out, np.full(64, k - 20 * 0.5 * 0.1), atol=1e-5)
                assert w.step(10 + k) == 20
            except Exception as e:  # reported below, on the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_one_future_waited_on_from_two_threads(server):
    # result() in one thread while another polls done(): whichever sees the
    # request finish first must not free it under the other's ember_wait
    # (this crashed the interpreter before the Future counted its waiters).
    with ember.Worker(server.config_path, rank=0) as w:
        w.init(7, values=np.zeros(12, np.float32))
        g = np.zeros(12, np.float32)
        for _ in range(300):
            f = w.push_pull_async(7, g)
            results = []
            t = threading.Thread(target=lambda: results.append(f.result()))
            t.start()
            while not f.done():
                pass
            t.join()
            assert len(results) == 1 and results[0].shape == (12,)
            assert f.result() is results[0]


def test_result_timeouts_inf_huge_and_nan(server):
    with ember.Worker(server.config_path, rank=0) as w:
        w.init(8, values=np.zeros(4, np.float32))
        g = np.ones(4, np.float32)
        assert w.push_async(8, g).result(timeout=float("inf")) == 0
        assert w.push_async(8, g).result(timeout=1e30) == 1
        f = w.push_async(8, g)
        with pytest.raises(ValueError, match="nan"):
            f.result(timeout=float("nan"))
        assert f.result() == 2


def test_rejoin_mid_step_follows_the_documented_rule(start_server):
    """A rank that died after pushing some of a step's keys rejoins with
    per-key steps one apart; the rule of init's docstring (resume at the
    smallest step, pull the keys already past it) completes the round, and
    the job goes on with the same parameters as without the restart."""
    s = start_server(num_workers=2, learning_rate=0.5)
    shape = (2,)
    w0 = ember.Worker(s.config_path, rank=0)
    w1 = ember.Worker(s.config_path, rank=1)
    try:
        t = threading.Thread(target=lambda: [w1.init(k, shape) for k in (1, 2)])
        t.start()
        for k in (1, 2):
            w0.init(k, values=np.zeros(2, np.float32))
        t.join()
        # Step 0: rank 0 pushes both keys; rank 1 pushes key 1 only, then dies.
        f = [w0.push_pull_async(k, np.ones(2)) for k in (1, 2)]
        w1.push_pull(1, np.full(2, 3.0))
        f[0].result()
        w1.close()
        w1 = ember.Worker(s.config_path, rank=1)
        steps = {k: w1.init(k, shape) for k in (1, 2)}
        assert steps == {1: 1, 2: 0}
        s0 = min(steps.values())
        for k in (1, 2):
            if w1.step(k) > s0:
                w1.pull(k)
            else:
                w1.push_pull(k, np.full(2, 3.0))
        f[1].result(timeout=10)
        # Step 1 on both ranks, each key at step 1 now.
        assert [w1.step(k) for k in (1, 2)] == [1, 1]
        f = [w0.push_pull_async(k, np.ones(2)) for k in (1, 2)]
        got = [w1.push_pull(k, np.full(2, 3.0)) for k in (1, 2)]
        for k in (0, 1):
            np.testing.assert_array_equal(f[k].result(timeout=10), got[k])
            np.testing.assert_array_equal(got[k], np.full(2, -2.0, np.float32))  # 2 x 0.5 x mean 2
    finally:
        w0.close()
        w1.close()


def test_a_forked_child_cannot_use_the_worker_and_exits(server):
    """A forked child has the parent's handles but not its I/O threads: it
    used to hang at exit (the atexit close) and to send on the parent's
    connection as the parent's rank."""
    import os
    import time

    with ember.Worker(server.config_path, rank=0) as w:
        w.init(3, values=np.zeros(4, np.float32))
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 1
            try:
                try:
                    w.push(3, np.ones(4, np.float32))
                except ember.EmberError as e:
                    if e.code == ember.E_CLOSED and "forked child" in str(e):
                        code = 0
                w.close()
                ember.worker._close_all_at_exit()  # what exiting runs
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not exit within 20 s")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        # The parent's worker is untouched: step 0 is still its to push.
        assert w.push(3, np.ones(4, np.float32)) == 0


def test_result_is_interrupted_by_a_signal(start_server):
    """Future.result() waits in slices: a signal handler's exception (Ctrl-C)
    comes through at once, not after request_timeout (20 s here)."""
    import signal
    import time

    class Interrupted(Exception):
        pass

    def on_alarm(signum, frame):
        raise Interrupted()

    s = start_server(num_workers=2, learning_rate=0.5)
    w0 = ember.Worker(s.config_path, rank=0)
    w1 = None
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        w0.init(6, values=np.zeros(2, np.float32))
        f = w0.push_pull_async(6, np.ones(2, np.float32))  # waits for rank 1
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            f.result()
        assert time.monotonic() - t0 < 5
        # The operation kept running: rank 1 completes the round.
        w1 = ember.Worker(s.config_path, rank=1)
        w1.init(6, (2,))
        w1.push_pull(6, np.ones(2, np.float32))
        np.testing.assert_allclose(f.result(timeout=20), np.full(2, -0.5))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        w0.close()
        if w1 is not None:
            w1.close()
