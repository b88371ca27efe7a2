"""Fixtures for the ember Python tests: the package from this checkout, and
real ember-server processes on 127.0.0.1 (free port, readiness read from the
server's "ember-server ready" line against a deadline; no sleeps).

Environment (set by the ctest registration in capi/CMakeLists.txt):
  EMBER_LIB         libember.so to load (else the package's own search)
  EMBER_SERVER_BIN  the ember-server binary (else <repo>/build/*/server/ember-server)
"""

import glob
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "python"))


def server_binary():
    env = os.environ.get("EMBER_SERVER_BIN")
    if env:
        return env
    found = glob.glob(os.path.join(REPO, "build", "*", "server", "ember-server"))
    if not found:
        pytest.fail("ember-server not found: set EMBER_SERVER_BIN or build the ember-server target")
    return max(found, key=os.path.getmtime)


_shm_next = [20000 + (os.getpid() * 131) % 40000]


def free_shm_address():
    """A host:port whose shm listening socket (the abstract unix socket
    "@ember-<host:port>") is not in use now: probed by binding it."""
    for _ in range(1000):
        port = _shm_next[0]
        _shm_next[0] = 20000 + (port - 20000 + 7919) % 40000
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.bind("\0ember-127.0.0.1:%d" % port)
        except OSError:
            continue
        finally:
            probe.close()
        return "127.0.0.1:%d" % port
    pytest.fail("no free shm listen name found")


def cluster_toml(servers, num_workers=1, consistency="bsp", optimizer="sgd", learning_rate=0.1,
                 request_timeout="20s", connect_retries=5, extra_optimizer="", transport="tcp"):
    quoted = ", ".join('"%s"' % s for s in servers)
    return (
        "[communication]\n"
        'transport = "%s"\n'
        "prealloc_pages = 16\n"
        'pool_backing = "plain"\n'
        'heartbeat_interval = "100ms"\n'
        'heartbeat_timeout = "2s"\n'
        "[cluster]\n"
        "servers = [%s]\n"
        "num_workers = %d\n"
        "[server]\n"
        'consistency = "%s"\n'
        'worker_timeout = "5s"\n'
        'log_level = "warn"\n'
        "[optimizer]\n"
        'type = "%s"\n'
        "learning_rate = %r\n"
        "%s\n"
        "[worker]\n"
        'request_timeout = "%s"\n'
        'connect_timeout = "5s"\n'
        "connect_retries = %d\n"
    ) % (transport, quoted, num_workers, consistency, optimizer, learning_rate, extra_optimizer,
         request_timeout, connect_retries)


class ServerProcess:
    """One ember-server on 127.0.0.1:<free port>, and the worker config for it."""

    def __init__(self, directory, **cluster):
        self.dir = directory
        server_cfg = os.path.join(directory, "server.toml")
        with open(server_cfg, "w") as f:
            # The server binds --listen; its own [cluster] entry is a placeholder.
            f.write(cluster_toml(["127.0.0.1:1"], **cluster))
        self.log_path = os.path.join(directory, "server.log")
        self._log = open(self.log_path, "wb")
        shm = cluster.get("transport") == "shm"
        listen = free_shm_address() if shm else "127.0.0.1:0"
        self.proc = subprocess.Popen(
            [server_binary(), "--config", server_cfg, "--listen", listen,
             "--set", "server.server_index=0"],
            stdout=subprocess.PIPE, stderr=self._log)
        line = self._wait_line("ember-server ready", 30.0)
        if line is None:
            self.stop()
            pytest.fail("ember-server did not come up; its log:\n" + self.log())
        # tcp: the port the server bound; shm: the host:port its abstract
        # socket is named after (the ready line prints the socket name).
        self.address = listen if shm else line.split("listen=", 1)[1].split()[0]
        self.config_path = os.path.join(directory, "worker.toml")
        with open(self.config_path, "w") as f:
            f.write(cluster_toml([self.address], **cluster))

    def _wait_line(self, prefix, timeout_s):
        deadline = time.monotonic() + timeout_s
        buf = b""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    text = line.decode("utf-8", "replace")
                    if text.startswith(prefix):
                        return text
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    return None
                buf += chunk
        finally:
            sel.close()

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=20)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


@pytest.fixture
def start_server(tmp_path):
    """start_server(**cluster) -> ServerProcess; all are stopped at the end."""
    started = []

    def start(**cluster):
        d = tmp_path / ("s%d" % len(started))
        d.mkdir()
        s = ServerProcess(str(d), **cluster)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def server(start_server):
    """One server, one worker, SGD with learning rate 0.5."""
    return start_server(learning_rate=0.5)
