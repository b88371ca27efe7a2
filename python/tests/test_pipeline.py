"""Worker.pipeline(): many small tensors enqueued, flushed together on exit,
futures, and errors."""

import numpy as np
import pytest

import ember


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pipeline_push_pull_many_keys(start_server, transport):
    s = start_server(learning_rate=1.0, transport=transport)
    with ember.Worker(s.config_path, rank=0) as w:
        n = 50
        params = [w.allocate(4) for _ in range(n)]
        for k in range(n):
            params[k][:] = np.arange(4) + 10 * k
            w.init(100 + k, values=params[k])
        futures = []
        with w.pipeline() as p:
            for k in range(n):
                futures.append(p.enqueue(100 + k, np.full(4, float(k), np.float32),
                                         out=params[k]))
        for k, f in enumerate(futures):
            assert f.done()
            assert f.result() is params[k]
            assert f.step == 1
            np.testing.assert_allclose(params[k], np.arange(4) + 10 * k - k)


def test_pipeline_push_and_pull_and_explicit_wait(start_server):
    s = start_server(learning_rate=0.5)
    with ember.Worker(s.config_path, rank=0) as w:
        w.init(1, values=np.zeros(8, np.float32))
        w.init(2, values=np.zeros(3, np.float32))
        p = w.pipeline()
        f1 = p.enqueue(1, np.ones(8))  # push
        f2 = p.enqueue(2, np.ones(3))
        p.wait()
        assert f1.result() == 0 and f2.result() == 0
        out = np.empty(8, np.float32)
        f3 = p.enqueue_pull(1, out)
        # Waiting on a queued (unsent) operation sends its pipeline first.
        assert f3.result(timeout=20) is out
        np.testing.assert_allclose(out, np.full(8, -0.5))
        p.close()
        with pytest.raises(ember.EmberError) as info:
            p.enqueue(1, np.ones(8))
        assert info.value.code == ember.E_CLOSED


def test_pipeline_error_raised_on_exit(server):
    with ember.Worker(server.config_path, rank=0) as w:
        w.init(1, values=np.zeros(4, np.float32))
        with pytest.raises(ember.EmberError) as info:
            with w.pipeline() as p:
                ok = p.enqueue(1, np.ones(4))
                bad = p.enqueue(999, np.ones(4))
        assert info.value.code == ember.E_NOT_FOUND
        assert "key 999" in info.value.message
        assert ok.result() == 0
        assert bad.exception().code == ember.E_NOT_FOUND
        # An exception inside the block wins over the pipeline's own errors.
        with pytest.raises(KeyError):
            with w.pipeline() as p:
                p.enqueue(998, np.ones(4))
                raise KeyError("mine")
