#!/usr/bin/env python3
"""Training benchmark: Fashion-MNIST data-parallel training through Ember
beside the same model trained in one process without Ember.

ember-server runs on the cores no worker is pinned to, when there are any
(server_pinning). Runs, interleaved, --reps times each:
  baseline   fmnist-baseline, batch B        (what 1 worker computes per step)
  baseline   fmnist-baseline, batch 2B       (what 2 workers compute per step)
  ember      1 and 2 workers x tcp and shm   (ember-server + fmnist-worker, bsp,
                                              workers pinned to cores with
                                              scripts/launch_workers.sh)
and prints, per configuration, the medians of: time per epoch (training time,
evaluation excluded), samples/s per worker, the communication share (time the
training thread is blocked on Ember over its training time, mean over the
workers) and the test accuracy. Targets (issue 5): comm share <= 3.7% with
shm and <= 10% with tcp; reported, never enforced (timing never fails a run).

The last line is
  SUMMARY comm_share_shm_1w=... comm_share_shm_2w=... comm_share_tcp_1w=...
          comm_share_tcp_2w=... epoch_ratio_<t>_<n>w=... shm_target_met=0|1
          tcp_target_met=0|1
where epoch_ratio_<t>_<n>w is Ember's time per epoch over the baseline's with
the same total batch (n*B), and a target is met when every run of that
transport is within it.

Usage: scripts/bench.sh train [--reps R] [--epochs E] [--batch-size B]
                             [--max-steps-per-epoch S] [--block-rows R]
   or: bench/train/run.py --build DIR [same options]
Binaries come from DIR (default build/release); scripts/bench.sh builds them
(target ember-bench-train) and runs this with --build build/release.
"""
import argparse
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def field(line, key):
    m = re.search(r"(?:^| )" + re.escape(key) + r"=([^ ]+)", line)
    if not m:
        raise RuntimeError(f"no {key}= in: {line}")
    return m.group(1)


def result_line(text, what):
    lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{what} printed no RESULT line:\n{text[-2000:]}")
    return lines[-1]


def free_ports(n):
    held = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        held.append(s)
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


def server_pinning(workers):
    """taskset prefix that keeps ember-server off the workers' cores.

    scripts/launch_workers.sh pins worker r to core r % (number of cores);
    the server gets the cores left (1 worker on 2 cores: the server on core
    1), so its threads do not preempt a worker's training thread. With no
    core left (2 workers on 2 cores) it runs unpinned."""
    spare = spare_cores(workers)
    return ["taskset", "-c", ",".join(map(str, spare))] if spare else []


def spare_cores(workers):
    """The allowed cores no worker is pinned to (worker r: core r % cores)."""
    ncpu = os.cpu_count() or 1
    return sorted(set(os.sched_getaffinity(0)) - {r % ncpu for r in range(workers)})


def worker_pinning(workers, transport):
    """launch_workers.sh arguments and worker options for the comm threads.

    tcp with a spare core: each worker's training thread keeps its own core
    (--compute-cpu) while its I/O thread runs on the first spare core, shared
    with the server, and writes every message itself (inline_write = 0): the
    socket system calls' copies leave the training core (1 worker: comm share
    12-14% -> 6-9%). Otherwise launch_workers' default (worker r on core r)
    and the config's defaults: over shm a push costs no copy, and handing it
    to an I/O thread on another core measured slower (comm share 4.1-4.3% ->
    4.1-6.3%)."""
    spare = spare_cores(workers)
    if not spare or transport != "tcp":
        return [], []
    cores = ":".join(f"{r},{spare[0]}" for r in range(workers))
    return (["--cores", cores],
            ["--compute-cpu", "{rank}", "--set", f"communication.cpu_affinity=[{spare[0]}]",
             "--set", "communication.inline_write=0"])


class Bench:
    def __init__(self, args):
        self.args = args
        self.build = os.path.abspath(args.build)
        self.server = os.path.join(self.build, "server", "ember-server")
        self.worker = os.path.join(self.build, "examples", "fashion_mnist", "fmnist-worker")
        self.baseline = os.path.join(self.build, "examples", "fashion_mnist", "fmnist-baseline")
        for b in (self.server, self.worker, self.baseline):
            if not os.access(b, os.X_OK):
                sys.exit(f"bench/train: {b} is missing; build it (scripts/bench.sh train does)")
        self.tmp = tempfile.mkdtemp(prefix="ember-bench-train.")
        self.common = ["--epochs", str(args.epochs), "--seed", "1",
                       "--block-rows", str(args.block_rows)]
        if args.max_steps_per_epoch:
            self.common += ["--max-steps-per-epoch", str(args.max_steps_per_epoch)]

    def run_baseline(self, batch):
        out = subprocess.run([self.baseline, "--batch-size", str(batch), "--optimizer", "sgd",
                              "--lr", "0.05", "--momentum", "0.9", *self.common],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"fmnist-baseline failed ({out.returncode}):\n{out.stderr[-2000:]}")
        r = result_line(out.stdout, "fmnist-baseline")
        return {"epoch_s": float(field(r, "train_s")) / self.args.epochs,
                "samples_per_s": float(field(r, "samples_per_s")),
                "comm_share": None,
                "accuracy": float(field(r, "test_accuracy"))}

    def run_ember(self, workers, transport):
        run_dir = tempfile.mkdtemp(dir=self.tmp, prefix=f"{transport}-{workers}w.")
        port = free_ports(1)[0]
        config = os.path.join(run_dir, "ember.toml")
        with open(config, "w") as f:
            subprocess.run([self.server, "--config", self.args.config,
                            "--print-config",
                            "--set", f"cluster.servers=127.0.0.1:{port}",
                            "--set", f"cluster.num_workers={workers}",
                            "--set", f"communication.transport={transport}",
                            "--set", "communication.prealloc_pages=32",
                            "--set", "server.consistency=bsp",
                            "--set", "server.on_worker_loss=fail",
                            "--set", "optimizer.type=momentum",
                            "--set", "optimizer.learning_rate=0.05",
                            "--set", "optimizer.momentum=0.9"],
                           stdout=f, check=True)
        server_log = open(os.path.join(run_dir, "server.log"), "w")
        server = subprocess.Popen([*server_pinning(workers), self.server, "--config", config],
                                  stdout=subprocess.PIPE, stderr=server_log, text=True)
        try:
            # The ready line, or EOF when the server exits; 30 s at most.
            readable, _, _ = select.select([server.stdout], [], [], 30)
            ready = server.stdout.readline() if readable else ""
            if not ready.startswith("ember-server ready"):
                raise RuntimeError(f"ember-server not ready within 30 s; see {run_dir}/server.log")
            launch_args, worker_args = worker_pinning(workers, transport) if self.args.comm_core else ([], [])
            launcher = subprocess.run(
                [os.path.join(ROOT, "scripts", "launch_workers.sh"), "--workers", str(workers),
                 *launch_args, "--log-dir", run_dir, "--", self.worker, "--config", config,
                 "--rank", "{rank}", "--batch-size", str(self.args.batch_size),
                 "--progress-every", "0", "--log-level", "warn", *worker_args, *self.common],
                capture_output=True, text=True, timeout=900)
            if launcher.returncode != 0:
                raise RuntimeError(f"workers failed ({launcher.returncode}); logs in {run_dir}")
            results = []
            for r in range(workers):
                with open(os.path.join(run_dir, f"worker-{r}.log")) as f:
                    results.append(result_line(f.read(), f"worker {r}"))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                rc = server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                rc = server.wait()
            server_log.close()
        if rc != 0:
            raise RuntimeError(f"ember-server exited with {rc} after SIGTERM; see {run_dir}")
        return {"epoch_s": max(float(field(r, "train_s")) for r in results) / self.args.epochs,
                "samples_per_s": statistics.mean(float(field(r, "samples_per_s")) for r in results),
                "comm_share": statistics.mean(float(field(r, "comm_share")) for r in results),
                "comm_share_max": max(float(field(r, "comm_share")) for r in results),
                "accuracy": statistics.mean(float(field(r, "test_accuracy")) for r in results)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--config", default=os.path.join(ROOT, "config", "ember.toml"),
                    help="base config the run configs are derived from")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--no-comm-core", dest="comm_core", action="store_false",
                    help="keep each worker's I/O thread on its training core even when a core "
                         "is spare (the layout before the comm core)")
    ap.add_argument("--max-steps-per-epoch", type=int, default=0)
    ap.add_argument("--block-rows", type=int, default=128,
                    help="rows per exchanged weight block (0: whole tensors), worker and baseline")
    args = ap.parse_args()
    if args.reps < 1 or args.epochs < 1 or args.batch_size < 1:
        sys.exit("bench/train: --reps, --epochs and --batch-size must be >= 1")
    if args.block_rows < 0:
        sys.exit("bench/train: --block-rows must be >= 0 (0: whole tensors)")
    b = Bench(args)
    B = args.batch_size
    configs = [("baseline", 1, None), ("baseline", 2, None),
               ("ember", 1, "tcp"), ("ember", 1, "shm"), ("ember", 2, "tcp"), ("ember", 2, "shm")]
    runs = {c: [] for c in configs}
    for rep in range(args.reps):
        for c in configs:
            kind, n, transport = c
            t0 = time.monotonic()
            r = b.run_baseline(n * B) if kind == "baseline" else b.run_ember(n, transport)
            runs[c].append(r)
            share = "" if r["comm_share"] is None else f" comm {100 * r['comm_share']:.1f}%"
            print(f"rep {rep + 1}/{args.reps} {kind} {n}x{B} {transport or ''}: "
                  f"epoch {r['epoch_s']:.2f} s{share} ({time.monotonic() - t0:.0f} s wall)",
                  file=sys.stderr, flush=True)

    def med(c, k):
        return statistics.median(r[k] for r in runs[c])

    print(f"\nFashion-MNIST MLP 784-256-128-10, bsp, momentum SGD lr 0.05, batch {B} per worker, "
          f"row blocks {args.block_rows or 'off'}, "
          f"{args.epochs} epoch(s){', ' + str(args.max_steps_per_epoch) + ' steps/epoch' if args.max_steps_per_epoch else ''}, "
          f"medians of {args.reps} interleaved reps")
    print(f"{'run':<30} {'epoch s':>8} {'samples/s/proc':>15} {'comm share':>11} {'test acc':>9}")
    for c in configs:
        kind, n, transport = c
        name = (f"baseline 1 process, batch {n * B}" if kind == "baseline"
                else f"ember {n} worker(s), {transport}")
        share = "-" if kind == "baseline" else f"{100 * med(c, 'comm_share'):.2f}%"
        print(f"{name:<30} {med(c, 'epoch_s'):>8.3f} {med(c, 'samples_per_s'):>15.0f} "
              f"{share:>11} {med(c, 'accuracy'):>9.4f}")
    targets = {"shm": 0.037, "tcp": 0.10}
    summary = []
    for t in ("shm", "tcp"):
        for n in (1, 2):
            summary.append(f"comm_share_{t}_{n}w={med(('ember', n, t), 'comm_share'):.4f}")
    for t in ("shm", "tcp"):
        for n in (1, 2):
            ratio = med(("ember", n, t), "epoch_s") / med(("baseline", n, None), "epoch_s")
            summary.append(f"epoch_ratio_{t}_{n}w={ratio:.3f}")
    for t in ("shm", "tcp"):
        met = all(r["comm_share_max"] <= targets[t] for n in (1, 2) for r in runs[("ember", n, t)])
        summary.append(f"{t}_target_met={int(met)}")
    print(f"(targets: comm share <= {100 * targets['shm']:.1f}% with shm, "
          f"<= {100 * targets['tcp']:.0f}% with tcp; epoch_ratio: ember over the baseline with the "
          f"same total batch)")
    print("SUMMARY " + " ".join(summary))


if __name__ == "__main__":
    main()
