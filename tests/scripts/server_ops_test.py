#!/usr/bin/python3
"""Operator-facing checks against a real ember-server on 127.0.0.1.

  server_ops_test.py notify   EMBER_SERVER
      systemd's Type=notify protocol without systemd: the test owns a
      datagram socket, starts ember-server with NOTIFY_SOCKET pointing at it
      and WATCHDOG_USEC set, and checks READY=1 (with a STATUS), then
      periodic WATCHDOG=1 pings, each gap shorter than the watchdog interval
      (systemd would kill a server whose gap exceeds it), then SIGTERM gives
      STOPPING=1 and exit status 0. Without WATCHDOG_USEC there are no pings.

  server_ops_test.py emberctl EMBER_SERVER EMBERCTL
      emberctl against the running server: status, stats (text and --raw),
      status --config (endpoint from the config), checkpoint (a checkpoint
      file appears, or the server says it does not take HTTP checkpoint
      requests: exit 3 with that message), tune --metrics on a server with
      no traffic (refused with the reason), and status of a server that is
      down (exit 1, DOWN).

  server_ops_test.py emberctl EMBER_SERVER EMBERCTL FMNIST_WORKER LAUNCHER
      the same, then a real training run: scripts/launch_workers.sh starts
      one fmnist-worker pinned to core 0 for 3 steps against a second server;
      afterwards `emberctl status` shows the worker's step and `emberctl tune
      --metrics` reads the average message size the server saw.

Nothing sleeps to wait: every wait is a poll/select on a socket or pipe
against a deadline.
"""

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


class Server:
    """ember-server child with stdout on a pipe; waits for its ready line."""

    def __init__(self, binary, args, env=None, stderr_path=None):
        self.stderr = open(stderr_path, "w") if stderr_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([binary] + args, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=env)
        self.listen = None
        self.metrics = None

    def wait_ready(self, timeout=20.0):
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("ember-server ready "):
                    fields = dict(f.split("=", 1) for f in line.split()[2:])
                    self.listen, self.metrics = fields.get("listen"), fields.get("metrics")
                    return line
        fail(f"ember-server printed no ready line within {timeout} s (exit {self.proc.poll()})")

    def stop(self, timeout=20.0):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            fail("ember-server did not exit within 20 s of SIGTERM")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# SO_TIMESTAMPNS (asm-generic/socket.h; Python's socket module lacks the
# name): the kernel stamps each datagram with the time it reached the socket.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def notify_socket(path):
    """The NOTIFY_SOCKET datagram socket, bound to `path`, with arrival
    timestamps: a ping's time is when the server sent it, not when this
    process (maybe descheduled on a loaded machine) got round to reading it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return sock


def recv_until(sock, predicate, timeout):
    """Datagrams until predicate(message) is true; returns (message, all seen),
    each seen entry (arrival time in seconds from the kernel's timestamp,
    message)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(16))
        msg = data.decode()
        stamps = [struct.unpack("@qq", d[:16]) for level, kind, d in ancillary
                  if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS]
        if not stamps:
            fail(f"datagram without its SO_TIMESTAMPNS arrival time: {msg!r}")
        seen.append((stamps[0][0] + stamps[0][1] / 1e9, msg))
        if predicate(msg):
            return msg, seen
    return None, seen


def test_notify(server_bin):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "notify.sock")
        sock = notify_socket(path)
        # 4 s: the server pings every WATCHDOG_USEC / 4; a gap must stay
        # below WATCHDOG_USEC, and 1 s left little room for a descheduled
        # timer on a loaded 2-core machine.
        watchdog_usec = 4_000_000
        env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC=str(watchdog_usec))
        env.pop("WATCHDOG_PID", None)
        srv = Server(server_bin, ["--listen", "127.0.0.1:0"], env=env,
                     stderr_path=os.path.join(tmp, "server.log"))
        try:
            msg, _ = recv_until(sock, lambda m: "READY=1" in m.split("\n"), 20)
            if msg is None:
                fail("no READY=1 within 20 s")
            if not any(l.startswith("STATUS=serving on 127.0.0.1:") for l in msg.split("\n")):
                fail(f"READY=1 without the STATUS line: {msg!r}")
            srv.wait_ready()
            pings = []
            deadline = time.monotonic() + 20
            while len(pings) < 3 and time.monotonic() < deadline:
                m, seen = recv_until(sock, lambda x: "WATCHDOG=1" in x.split("\n"),
                                     deadline - time.monotonic())
                if m is None:
                    break
                pings.append(seen[-1][0])
            if len(pings) < 3:
                fail(f"{len(pings)} WATCHDOG=1 pings in 20 s with WATCHDOG_USEC={watchdog_usec}")
            gaps = [b - a for a, b in zip(pings, pings[1:])]
            if max(gaps) >= watchdog_usec / 1e6:
                fail(f"a watchdog gap of {max(gaps):.3f} s reached WATCHDOG_USEC (gaps {gaps})")
            srv.proc.send_signal(signal.SIGTERM)
            m, _ = recv_until(sock, lambda x: "STOPPING=1" in x.split("\n"), 20)
            if m is None:
                fail("no STOPPING=1 after SIGTERM")
            rc = srv.stop()
            if rc != 0:
                fail(f"exit status {rc} after SIGTERM, want 0")
        finally:
            srv.kill()

        # Without WATCHDOG_USEC: READY=1 but no pings.
        env = dict(os.environ, NOTIFY_SOCKET=path)
        env.pop("WATCHDOG_USEC", None)
        srv = Server(server_bin, ["--listen", "127.0.0.1:0"], env=env)
        try:
            if recv_until(sock, lambda m: "READY=1" in m.split("\n"), 20)[0] is None:
                fail("no READY=1 without a watchdog")
            m, _ = recv_until(sock, lambda x: "WATCHDOG=1" in x.split("\n"), 1.5)
            if m is not None:
                fail("WATCHDOG=1 sent although WATCHDOG_USEC is unset")
            if srv.stop() != 0:
                fail("non-zero exit without a watchdog")
        finally:
            srv.kill()
        sock.close()
    print(f"server_ops_test notify: ok (ping gaps {min(gaps):.3f} .. {max(gaps):.3f} s)")


def run(cmd, timeout=60):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def expect(cond, what, out=""):
    if not cond:
        fail(f"{what}\n--- output ---\n{out}")


def test_emberctl(server_bin, ctl, worker=None, launcher=None):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        os.mkdir(ckpt)
        cfg = os.path.join(tmp, "job.toml")
        with open(cfg, "w") as f:
            f.write(f'[cluster]\nnum_workers = 2\n[server]\ncheckpoint_dir = "{ckpt}"\n'
                    'metrics_listen = "127.0.0.1:0"\n')
        srv = Server(server_bin, ["--config", cfg, "--listen", "127.0.0.1:0"],
                     stderr_path=os.path.join(tmp, "server.log"))
        try:
            srv.wait_ready()
            expect(srv.metrics, "the server reported no metrics address")
            m = srv.metrics

            rc, out, err = run([ctl, "status", "--metrics", m])
            expect(rc == 0, f"status exit {rc}", out + err)
            expect(f"server 0  metrics {m}  up" in out, "status: not up", out)
            # num_workers = 2: the server exports a step gauge per rank.
            expect("workers connected   0 of 2" in out, "status: workers line", out)
            expect("rank 0: 0, rank 1: 0" in out, "status: steps line", out)
            expect(" in use (" in out, "status: pool line", out)
            expect("hugepages on this host:" in out, "status: host hugepages", out)

            # The endpoint from a config (port known now).
            port = m.rsplit(":", 1)[1]
            cfg2 = os.path.join(tmp, "job2.toml")
            with open(cfg2, "w") as f:
                f.write(f'[cluster]\nservers = ["{srv.listen}"]\nnum_workers = 2\n'
                        f'[server]\nmetrics_listen = "127.0.0.1:{port}"\n')
            rc, out, err = run([ctl, "status", "--config", cfg2])
            expect(rc == 0 and "workers connected   0 of 2" in out, "status --config", out + err)

            rc, out, err = run([ctl, "stats", "--metrics", m])
            expect(rc == 0 and "traffic\n  bytes received" in out and "request latency" in out,
                   "stats text", out + err)
            rc, out, err = run([ctl, "stats", "--metrics", m, "--raw"])
            expect(rc == 0 and "# TYPE ember_server_workers_connected gauge" in out, "stats --raw",
                   out + err)

            before = set(os.listdir(ckpt))
            rc, out, err = run([ctl, "checkpoint", "--metrics", m, "--timeout", "30s"])
            if rc == 0:
                expect("checkpoint written" in out, "checkpoint: no confirmation", out + err)
                expect(set(os.listdir(ckpt)) - before, "checkpoint: exit 0 but no new file", out)
                print("emberctl checkpoint: written over HTTP")
            else:
                expect(rc == 3 and "does not take checkpoint requests over HTTP" in err,
                       f"checkpoint: exit {rc}", out + err)
                print("emberctl checkpoint: this server has no POST /checkpoint yet (exit 3)")

            rc, out, err = run([ctl, "tune", "--rtt", "50us", "--bandwidth", "10Gbit",
                                "--workers", "2", "--metrics", m])
            expect(rc == 2 and "no message yet" in err, f"tune --metrics without traffic: {rc}",
                   out + err)
        finally:
            code = srv.stop()
        expect(code == 0, f"server exit {code}")
        rc, out, err = run([ctl, "status", "--metrics", m, "--timeout", "2s"])
        expect(rc == 1 and "DOWN" in out, "status of a stopped server", out + err)
        if worker:
            train_then_inspect(server_bin, ctl, worker, launcher, tmp)
    print("server_ops_test emberctl: ok")


def train_then_inspect(server_bin, ctl, worker, launcher, tmp):
    # The server's [cluster] holds a placeholder address (it binds port 0);
    # the worker's names the real one. Join checks the shape, not addresses.
    scfg = os.path.join(tmp, "train-server.toml")
    with open(scfg, "w") as f:
        f.write('[communication]\npool_backing = "plain"\nprealloc_pages = 16\n'
                '[cluster]\nservers = ["127.0.0.1:1"]\nnum_workers = 1\n'
                '[server]\nmetrics_listen = "127.0.0.1:0"\n')
    srv = Server(server_bin, ["--config", scfg, "--listen", "127.0.0.1:0"],
                 stderr_path=os.path.join(tmp, "train-server.log"))
    try:
        srv.wait_ready()
        wcfg = os.path.join(tmp, "train-worker.toml")
        with open(wcfg, "w") as f:
            f.write('[communication]\npool_backing = "plain"\nprealloc_pages = 16\n'
                    f'[cluster]\nservers = ["{srv.listen}"]\nnum_workers = 1\n'
                    '[worker]\nconnect_retries = 3\n')
        logs = os.path.join(tmp, "worker-logs")
        rc, out, err = run([launcher, "--workers", "1", "--cores", "0", "--log-dir", logs, "--",
                            worker, "--config", wcfg, "--rank", "{rank}", "--epochs", "1",
                            "--max-steps-per-epoch", "3", "--max-eval-samples", "100"], timeout=120)
        log = open(os.path.join(logs, "worker-0.log")).read() if os.path.exists(
            os.path.join(logs, "worker-0.log")) else ""
        expect(rc == 0 and "RESULT rank=0" in log, f"training run exit {rc}", err + log)
        rc, out, err = run([ctl, "status", "--metrics", srv.metrics])
        expect(rc == 0 and "step per worker     rank 0: " in out, "status after training", out + err)
        step = int(out.split("rank 0: ")[1].split()[0])
        expect(step >= 2, f"step of rank 0 is {step} after 3 steps", out)
        rc, out, err = run([ctl, "tune", "--rtt", "50us", "--bandwidth", "10Gbit", "--workers", "1",
                            "--metrics", srv.metrics])
        expect(rc == 0 and "average message: " in out and "recommended:" in out,
               "tune --metrics after training", out + err)
        print(f"training run: rank 0 at step {step}; " + out.split("average message: ")[1].split("\n")[0])
    finally:
        code = srv.stop()
    expect(code == 0, f"training server exit {code}")


def main(argv):
    if len(argv) >= 2 and argv[0] == "notify":
        test_notify(argv[1])
    elif len(argv) in (3, 5) and argv[0] == "emberctl":
        test_emberctl(*argv[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
