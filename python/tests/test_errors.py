"""Errors through the Python package: bad config paths and files, an absent
server, wrong keys and sizes, bad arguments — each an exception with Ember's
code and message, never a crash."""

import os
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

import conftest
import ember


def test_version_and_codes():
    assert ember.version() == ember.__version__
    assert ember.version().count(".") == 2
    assert ember.error_name(ember.E_NOT_FOUND) == "not_found"
    assert ember.error_name(ember.PENDING) == "pending"
    assert ember.error_name(999) == "unknown"


def test_out_of_step_code_is_mapped():
    # A server restored from an older checkpoint refuses a step that does not
    # follow its own with this code (worker.h, "Out of step").
    assert ember.E_OUT_OF_STEP == 21
    assert ember.error_name(ember.E_OUT_OF_STEP) == "out_of_step"
    assert ember.error_name(ember.E_OUT_OF_STEP + 1) == "unknown"
    e = ember.EmberError(ember.E_OUT_OF_STEP, "out_of_step: push_pull of key 1 step 8 ...")
    assert e.code == ember.E_OUT_OF_STEP and e.name == "out_of_step"


def test_missing_config_file_is_config_error_naming_the_path():
    with pytest.raises(ember.EmberError) as info:
        ember.Worker("/nonexistent/dir/ember.toml", rank=0)
    e = info.value
    assert e.code == ember.E_CONFIG
    assert e.name == "config"
    assert "/nonexistent/dir/ember.toml" in e.message
    assert str(e) == e.message


def test_invalid_config_file_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[communication]\nbatch_treshold = "4KB"\n')
    with pytest.raises(ember.EmberError) as info:
        ember.Worker(str(path))
    assert info.value.code == ember.E_CONFIG
    assert "bad.toml:2" in info.value.message
    assert "batch_treshold" in info.value.message


def test_bad_override_and_rank(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("[cluster]\nnum_workers = 2\n")
    with pytest.raises(ember.EmberError) as info:
        ember.Worker(str(path), rank=0, overrides=["worker.no_such_key=1"])
    assert info.value.code == ember.E_CONFIG
    assert "no_such_key" in info.value.message
    with pytest.raises(ember.EmberError) as info:
        ember.Worker(str(path), rank=2)
    assert info.value.code == ember.E_CONFIG
    with pytest.raises(ValueError):
        ember.Worker(str(path), rank=-1)
    # A NUL would cut the C string short without a word.
    with pytest.raises(ValueError, match="config_path holds a NUL"):
        ember.Worker(str(path) + "\0junk", rank=0)
    with pytest.raises(ValueError, match="override holds a NUL"):
        ember.Worker(str(path), rank=0, overrides=["worker.rank=0\0junk"])
    # A lone string would be read one character at a time ("override 'w' has no '='").
    with pytest.raises(TypeError, match="overrides must be a list"):
        ember.Worker(str(path), rank=0, overrides="worker.request_timeout=5s")
    # A bytes path that is not UTF-8 (legal on Linux): a clear error, not UnicodeDecodeError.
    with pytest.raises(ValueError, match="config_path must be UTF-8 text"):
        ember.Worker(b"/tmp/\xff.toml", rank=0)
    # bytes overrides are UTF-8 text, not "b'...'".
    with pytest.raises(ember.EmberError) as info:
        ember.Worker(path, rank=0, overrides=[b"worker.no_such_key=1"])
    assert "'worker.no_such_key'" in info.value.message, info.value.message


def test_absent_server_is_an_error_naming_it(tmp_path):
    # Bound but not listening: connections are refused while it is open.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        path = tmp_path / "absent.toml"
        path.write_text('[cluster]\nservers = ["127.0.0.1:%d"]\n'
                        '[worker]\nconnect_timeout = "1s"\nconnect_retries = 1\n' % port)
        with pytest.raises(ember.EmberError) as info:
            ember.Worker(str(path), rank=0)
        assert info.value.code in (ember.E_IO, ember.E_TIMEOUT)
        assert "cannot connect to server 0 at 127.0.0.1:%d" % port in info.value.message
        assert "connect_retries" in info.value.message
    finally:
        s.close()


def test_errors_are_per_thread(tmp_path):
    seen = {}

    def other():
        try:
            ember.Worker("/nope/other.toml")
        except ember.EmberError as e:
            seen["other"] = e.message

    t = threading.Thread(target=other)
    with pytest.raises(ember.EmberError) as info:
        ember.Worker("/nope/main.toml")
    t.start()
    t.join()
    assert "/nope/main.toml" in info.value.message
    assert "/nope/other.toml" in seen["other"]


def test_set_log_level():
    ember.set_log_level("warn")
    with pytest.raises(ember.EmberError) as info:
        ember.set_log_level("loud")
    assert info.value.code == ember.E_INVALID_ARGUMENT
    assert "unknown level 'loud'" in info.value.message


def test_wrong_key_and_sizes_with_a_real_server(server):
    with ember.Worker(server.config_path, rank=0) as w:
        w.init(1, values=np.ones(4, np.float32))
        with pytest.raises(ember.EmberError) as info:
            w.push(2, np.ones(4, np.float32))
        assert info.value.code == ember.E_NOT_FOUND
        assert "key 2" in info.value.message
        with pytest.raises(ember.EmberError) as info:
            w.pull(2, out=np.zeros(4, np.float32))
        assert info.value.code == ember.E_NOT_FOUND
        with pytest.raises(ember.EmberError) as info:
            w.pull(2)  # no out and no shape known
        assert info.value.code == ember.E_NOT_FOUND
        fut = w.push_async(2, np.ones(4, np.float32))
        with pytest.raises(ember.EmberError) as info:
            fut.result()
        assert info.value.code == ember.E_NOT_FOUND
        assert isinstance(fut.exception(), ember.EmberError)

        with pytest.raises(ember.EmberError) as info:
            w.push(1, np.ones(3, np.float32))
        assert info.value.code == ember.E_INVALID_ARGUMENT
        assert "4 elements but 3 were given" in info.value.message
        with pytest.raises(ember.EmberError) as info:
            w.init(1, values=np.ones((2, 2)))
        assert info.value.code == ember.E_SHAPE_MISMATCH
        with pytest.raises(ember.EmberError) as info:
            w.init(3, shape=(4,), values=np.ones(3))
        assert info.value.code == ember.E_INVALID_ARGUMENT
        with pytest.raises(ember.EmberError) as info:
            w.set_learning_rate(-1.0)
        assert info.value.code == ember.E_INVALID_ARGUMENT

        # Python-side argument checks.
        with pytest.raises(ValueError):
            w.push(-1, np.ones(4))
        with pytest.raises(TypeError):
            w.push("1", np.ones(4))
        with pytest.raises(TypeError, match="gradient must be an array .* got None"):
            w.push(1, None)
        with pytest.raises(TypeError):
            w.pull(1, out=np.zeros(4, np.float64))
        with pytest.raises(ValueError):
            w.pull(1, out=np.zeros(8, np.float32)[::2])
        with pytest.raises(ember.EmberError) as info:
            w.buffer_info(np.zeros(4, np.float32))
        assert info.value.code == ember.E_NOT_FOUND

        # Still usable after all that.
        out = w.push_pull(1, np.ones(4))
        np.testing.assert_allclose(out, np.full(4, 0.5))
    assert w.closed
    with pytest.raises(ember.EmberError) as info:
        w.push(1, np.ones(4))
    assert info.value.code == ember.E_CLOSED


def test_shapes_that_ctypes_would_wrap_or_that_differ_from_the_keys(server):
    with ember.Worker(server.config_path, rank=0) as w:
        for shape in [(2**64 + 3,), (2**64,), (-1, 4)]:
            with pytest.raises(ValueError, match="0 .. 2\\*\\*64-1"):
                w.init(40, shape=shape, values=[1, 2, 3])
        with pytest.raises(ValueError):
            w.allocate((-2,))
        # A fractional dimension is refused, not cut short (int(2.9) == 2).
        for shape in [(2.9,), 2.0, (2, True)]:
            with pytest.raises(TypeError, match="shape dimensions must be ints"):
                w.init(40, shape=shape, values=[1, 2])
        with pytest.raises(TypeError, match="shape dimensions must be ints"):
            w.allocate((2.5, 2))
        for shape, dtype in [((2**62,), np.float64), ((2**32, 2**32), np.float32)]:
            with pytest.raises(ember.EmberError) as info:
                w.allocate(shape, dtype)
            assert info.value.code == ember.E_TOO_LARGE, info.value.message
        w.init(41, values=np.zeros((3, 4), np.float32))
        transposed = np.ones((4, 3), np.float32)
        for call in [lambda: w.push(41, transposed), lambda: w.pull(41, out=np.empty((4, 3), np.float32)),
                     lambda: w.push_pull(41, np.ones((3, 4)), out=np.empty((2, 6), np.float32)),
                     lambda: w.push_async(41, transposed)]:
            with pytest.raises(ember.EmberError) as info:
                call()
            assert info.value.code == ember.E_SHAPE_MISMATCH
            assert "init-ed with shape (3, 4)" in info.value.message
        with w.pipeline() as p:
            with pytest.raises(ember.EmberError) as info:
                p.enqueue(41, transposed)
            assert info.value.code == ember.E_SHAPE_MISMATCH
        # The key's own shape, and a flat array of its size, go through.
        assert w.push(41, np.ones((3, 4), np.float32)) == 0
        assert w.push(41, np.ones(12, np.float32)) == 1
        assert w.pull(41, out=np.empty(12, np.float32)).shape == (12,)
        # Size-1 dimensions added or dropped, and a scalar for a 1-element key.
        w.init(43, values=np.zeros(4, np.float32))
        assert w.push(43, np.ones((1, 4), np.float32)) == 0
        assert w.pull(43, out=np.empty((4, 1), np.float32)).shape == (4, 1)
        w.init(44, values=np.zeros(1, np.float32))
        assert w.push(44, 0.5) == 0


def test_init_of_a_tensor_larger_than_the_host_is_too_large(server):
    if os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >= 2**41:
        pytest.skip("this host holds 2 TiB")
    with ember.Worker(server.config_path, rank=0) as w:
        with pytest.raises(ember.EmberError) as info:
            w.init(45, shape=(2**39,))
        assert info.value.code == ember.E_TOO_LARGE
        assert "shape [549755813888] is 2 TiB" in info.value.message
        w.init(45, values=np.zeros(2, np.float32))  # the key is still free


def test_pipeline_used_after_its_worker_closed_says_closed(server):
    w = ember.Worker(server.config_path, rank=0)
    w.init(42, values=np.zeros(4, np.float32))
    p = w.pipeline()
    p.enqueue(42, np.ones(4, np.float32))
    p.flush()
    w.close()
    with pytest.raises(ember.EmberError) as info:
        p.wait()
    assert info.value.code == ember.E_CLOSED
    p.close()  # a no-op: the worker's close ended the pipeline
    with pytest.raises(ember.EmberError) as info:
        p.enqueue(42, np.ones(4, np.float32))
    assert info.value.code == ember.E_CLOSED


def test_server_gone_is_an_error(start_server):
    s = start_server(request_timeout="3s", connect_retries=0)
    with ember.Worker(s.config_path, rank=0) as w:
        w.init(1, values=np.ones(8, np.float32))
        s.kill()
        with pytest.raises(ember.EmberError) as info:
            w.push_pull(1, np.ones(8))
        assert info.value.code in (ember.E_CLOSED, ember.E_IO, ember.E_TIMEOUT)


def test_library_not_found_is_a_clear_import_error(tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ, EMBER_LIB=str(tmp_path / "libember.so.0"),
               PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run([sys.executable, "-c", "import ember"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "ImportError" in out.stderr
    assert "cannot load libember.so" in out.stderr
    assert str(tmp_path / "libember.so.0") in out.stderr
    assert "EMBER_LIB" in out.stderr
    # How to build it, for either preset the package looks in.
    assert "cmake --build build/release --target ember_capi" in out.stderr
    assert "cmake --build build/dev --target ember_capi" in out.stderr


class _ServerAt(conftest.ServerProcess):
    """ember-server on a given --listen address (to restart it on the same
    one), with extra --set overrides; log in <directory>/<name>.log."""

    def __init__(self, directory, name, config_path, listen, sets):
        self.dir = directory
        self.log_path = os.path.join(directory, name + ".log")
        self._log = open(self.log_path, "wb")
        args = [conftest.server_binary(), "--config", config_path, "--listen", listen]
        for s in sets:
            args += ["--set", s]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log)
        line = self._wait_line("ember-server ready", 30.0)
        if line is None:
            self.stop()
            pytest.fail("ember-server did not come up; its log:\n" + self.log())
        self.address = line.split("listen=", 1)[1].split()[0]


def test_server_restored_from_an_older_checkpoint_raises_out_of_step(tmp_path):
    # kill -9 after the workers went past the newest checkpoint: the restarted
    # server refuses their step at once (not after request_timeout), and
    # Worker.step(key) is then the server's step, from which the job goes on.
    d = str(tmp_path)
    server_cfg = os.path.join(d, "server.toml")
    with open(server_cfg, "w") as f:
        f.write(conftest.cluster_toml(["127.0.0.1:1"], learning_rate=0.5))
    sets = ["server.server_index=0", "server.checkpoint_dir=" + os.path.join(d, "ckpt")]
    servers = [_ServerAt(d, "first", server_cfg, "127.0.0.1:0", sets)]
    try:
        address = servers[0].address
        worker_cfg = os.path.join(d, "worker.toml")
        with open(worker_cfg, "w") as f:
            f.write(conftest.cluster_toml([address], learning_rate=0.5))
        with ember.Worker(worker_cfg, rank=0) as w:
            w.init(3, values=np.zeros(4, np.float32))
            g = np.ones(4, np.float32)
            for _ in range(2):
                w.push_pull(3, g)
            w.checkpoint()
            at_checkpoint = w.pull(3)
            for _ in range(3):
                w.push_pull(3, g)
            assert w.step(3) == 5
            servers[0].kill()
            servers.append(_ServerAt(d, "restarted", server_cfg, address, sets))
            start = time.monotonic()
            with pytest.raises(ember.EmberError) as info:
                w.push_pull(3, g)
            assert time.monotonic() - start < 10.0  # request_timeout is 20s
            e = info.value
            assert e.code == ember.E_OUT_OF_STEP
            assert e.name == "out_of_step"
            assert "push_pull of key 3 step 5" in e.message
            assert "which is at step 2 for that rank" in e.message
            assert w.step(3) == 2
            np.testing.assert_array_equal(w.pull(3), at_checkpoint)
            after = w.push_pull(3, g)
            assert w.step(3) == 3
            np.testing.assert_array_equal(after, at_checkpoint - 0.5 * g)
        assert "out_of_step" in servers[1].log()
    finally:
        for s in servers:
            s.stop()
