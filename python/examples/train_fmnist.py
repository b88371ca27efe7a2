#!/usr/bin/python3
"""Data-parallel Fashion-MNIST training in Python through ember-server.

A numpy MLP 784-H-10 (ReLU, softmax cross-entropy; --hidden 0 gives softmax
regression) trained by N worker processes, each on its shard of every
epoch's shuffled training set (rank r takes every N-th batch). Each step a
worker computes its batch's mean gradient into page-pool arrays and pushes
them through one pipeline: the output layer's gradients are enqueued and
sent as soon as backward produces them, while the first layer's are still
being computed; leaving the pipeline waits for the new parameters, which land
directly in the pool arrays the model computes with (zero copies on the
worker side). The server averages the workers' gradients (bsp) and applies
the optimizer of the config ([optimizer] type and learning_rate).

Data: the gzipped IDX files of the Debian package dataset-fashion-mnist
(/usr/share/datasets/fashion-mnist), read with the gzip module.

    ember-server --config job.toml &
    for r in 0 1; do /usr/bin/python3 python/examples/train_fmnist.py --config job.toml --rank $r & done

It needs numpy (Debian python3-numpy, hence /usr/bin/python3) and libember.so
(the ember_capi target; ember._native says where the package looks for it).

Per epoch each worker prints: training loss, test accuracy (10,000 images),
samples per second, and the communication share (time blocked on Ember /
step time). At the end it prints "done rank=... steps=... first_loss=...
last_loss=... first_mean=... last_mean=... test_acc=..." (the means are over
the first and last 5 steps); --max-steps stops it after that many steps.
"""

import argparse
import gzip
import os
import struct
import sys
import time

try:
    import numpy as np
except ModuleNotFoundError:
    sys.exit(f"train_fmnist.py: numpy is missing from {sys.executable}; run it with Debian's "
             "/usr/bin/python3 (package python3-numpy, which scripts/install-deps.sh installs)")

DATA_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


def read_idx(path, magic, ndim):
    """An IDX array (uint8). Errors name the file and the package to install."""
    if not os.path.exists(path):
        raise SystemExit("train_fmnist: %s is missing; install the Debian package "
                         "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)" % path)
    try:
        with open(path, "rb") as f:
            data = gzip.decompress(f.read())  # one shot: faster than streaming
    except (OSError, EOFError) as e:
        raise SystemExit("train_fmnist: %s is not a readable gzip file (%s); reinstall "
                         "dataset-fashion-mnist" % (path, e))
    header = 4 + 4 * ndim
    if len(data) < header or struct.unpack(">I", data[:4])[0] != magic:
        raise SystemExit("train_fmnist: %s is not an IDX file with magic 0x%08x; reinstall "
                         "dataset-fashion-mnist" % (path, magic))
    dims = struct.unpack(">" + "I" * ndim, data[4:header])
    count = int(np.prod(dims))
    if len(data) - header != count:
        raise SystemExit("train_fmnist: %s holds %d bytes of data, its header says %d; "
                         "reinstall dataset-fashion-mnist" % (path, len(data) - header, count))
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load(data_dir):
    """Images as uint8 [n, 784] (scaled to [0, 1] per batch, see pixels()),
    labels as int64 [n]."""
    p = {k: os.path.join(data_dir, v) for k, v in FILES.items()}
    x_train = read_idx(p["train_images"], 0x803, 3).reshape(-1, 784)
    y_train = read_idx(p["train_labels"], 0x801, 1).astype(np.int64)
    x_test = read_idx(p["test_images"], 0x803, 3).reshape(-1, 784)
    y_test = read_idx(p["test_labels"], 0x801, 1).astype(np.int64)
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise SystemExit("train_fmnist: image and label counts differ in %s" % data_dir)
    return x_train, y_train, x_test, y_test


def pixels(images):
    """uint8 images [n, 784] -> float32 in [0, 1]."""
    return images.astype(np.float32) * np.float32(1.0 / 255.0)


class Model:
    """MLP parameters and gradients, all in the worker's page pool.

    Keys: 1 W1 [784, H], 2 b1 [H], 3 W2 [H, 10], 4 b2 [10] (H = hidden), or
    with hidden == 0 only 1 W [784, 10] and 2 b [10]. float32, C order.
    """

    def __init__(self, worker, hidden, seed):
        self.hidden = hidden
        dims = [784, hidden, 10] if hidden > 0 else [784, 10]
        shapes = []
        for fan_in, fan_out in zip(dims[:-1], dims[1:]):
            shapes += [(fan_in, fan_out), (fan_out,)]
        self.keys = list(range(1, len(shapes) + 1))
        self.params = [worker.allocate(s) for s in shapes]
        self.grads = [worker.allocate(s) for s in shapes]
        rng = np.random.default_rng(seed)
        for p, s in zip(self.params, shapes):
            if len(s) == 2:  # He initialisation for ReLU layers, Glorot-like for the output
                p[:] = rng.standard_normal(s, dtype=np.float32) * np.float32(np.sqrt(2.0 / s[0]))
            else:
                p[:] = 0.0
        # Rank 0's values are the job's initial parameters; other ranks pull them.
        for k, p in zip(self.keys, self.params):
            worker.init(k, shape=p.shape, values=p if worker.rank == 0 else None)
        for k, p in zip(self.keys, self.params):
            worker.pull(k, out=p)

    def logits(self, x):
        if self.hidden == 0:
            return x @ self.params[0] + self.params[1], None
        h = np.maximum(x @ self.params[0] + self.params[1], 0.0)
        return h @ self.params[2] + self.params[3], h

    def accuracy(self, x, y, batch=2000):
        hits = 0
        for i in range(0, len(x), batch):
            z, _ = self.logits(pixels(x[i:i + batch]))
            hits += int((z.argmax(axis=1) == y[i:i + batch]).sum())
        return hits / len(x)

    def step(self, worker, x, y):
        """One training step; returns (loss, seconds blocked on Ember)."""
        n = len(x)
        z, h = self.logits(x)
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        prob = e / e.sum(axis=1, keepdims=True)
        loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
        dz = prob
        dz[np.arange(n), y] -= 1.0
        dz /= n
        g = self.grads
        blocked = 0.0
        with worker.pipeline() as pipe:
            if self.hidden == 0:
                np.matmul(x.T, dz, out=g[0])
                g[1][:] = dz.sum(axis=0)
                for k, gr, p in zip(self.keys, g, self.params):
                    pipe.enqueue(k, gr, out=p)
            else:
                np.matmul(h.T, dz, out=g[2])
                g[3][:] = dz.sum(axis=0)
                dh = dz @ self.params[2].T  # before W2 is overwritten by its pull
                # Output layer first: on the wire while layer 1's gradient is computed.
                pipe.enqueue(self.keys[2], g[2], out=self.params[2])
                pipe.enqueue(self.keys[3], g[3], out=self.params[3])
                t = time.perf_counter()
                pipe.flush()
                blocked += time.perf_counter() - t
                dh *= h > 0
                np.matmul(x.T, dh, out=g[0])
                g[1][:] = dh.sum(axis=0)
                pipe.enqueue(self.keys[0], g[0], out=self.params[0])
                pipe.enqueue(self.keys[1], g[1], out=self.params[1])
            t = time.perf_counter()
        # Leaving the pipeline sent the rest and waited for every reply.
        blocked += time.perf_counter() - t
        return loss, blocked


def import_ember():
    """The ember package of this checkout. Imported once the arguments are
    parsed, so that --help works before libember.so is built."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import ember
    except ImportError as e:
        raise SystemExit("train_fmnist: %s" % e)
    return ember


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the job's TOML config (same as the servers')")
    ap.add_argument("--rank", type=int, default=None, help="this worker's rank (default: config)")
    ap.add_argument("--epochs", type=int, default=3, help="(default: 3)")
    ap.add_argument("--batch-size", type=int, default=64, help="per worker (default: 64)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden units, 0 = softmax regression (default: 128)")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate set on the servers by rank 0 (default: the config's)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all)")
    ap.add_argument("--log-every", type=int, default=0, help="print the loss every N steps")
    ap.add_argument("--seed", type=int, default=1, help="(default: 1)")
    ap.add_argument("--data-dir", default=DATA_DIR)
    args = ap.parse_args(argv)

    ember = import_ember()
    x_train, y_train, x_test, y_test = load(args.data_dir)
    try:
        worker = ember.Worker(args.config, rank=args.rank)
    except ember.EmberError as e:
        raise SystemExit("train_fmnist: %s" % e)
    with worker:
        rank, nw = worker.rank, worker.num_workers
        model = Model(worker, args.hidden, args.seed)
        if args.lr is not None and rank == 0:
            worker.set_learning_rate(args.lr)
        worker.barrier()  # everyone starts with the same parameters and rate
        batches = len(x_train) // (args.batch_size * nw)  # same step count on every rank
        print("rank %d of %d: trains on %d of the %d training images per epoch (its batches of "
              "a shared shuffle), tests on %d; %d steps per epoch, batch %d, hidden %d"
              % (rank, nw, batches * args.batch_size, len(x_train), len(x_test), batches,
                 args.batch_size, args.hidden),
              flush=True)
        step = 0
        all_losses = []
        for epoch in range(1, args.epochs + 1):
            # Every rank draws the same permutation and takes its own batches.
            order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(x_train))
            t0 = time.perf_counter()
            blocked = 0.0
            losses = []
            for b in range(batches):
                idx = order[(b * nw + rank) * args.batch_size:(b * nw + rank + 1) * args.batch_size]
                loss, waited = model.step(worker, pixels(x_train[idx]), y_train[idx])
                blocked += waited
                losses.append(loss)
                all_losses.append(loss)
                step += 1
                if args.log_every and step % args.log_every == 0:
                    print("step %d loss %.4f" % (step, loss), flush=True)
                if args.max_steps and step >= args.max_steps:
                    break
            elapsed = time.perf_counter() - t0
            acc = model.accuracy(x_test, y_test)
            print("epoch %d rank %d loss %.4f test_acc %.4f samples/s %.0f comm_share %.3f"
                  % (epoch, rank, float(np.mean(losses)), acc,
                     len(losses) * args.batch_size / elapsed, blocked / elapsed), flush=True)
            if args.max_steps and step >= args.max_steps:
                break
        k = min(5, len(all_losses))
        print("done rank=%d steps=%d first_loss=%.4f last_loss=%.4f first_mean=%.4f "
              "last_mean=%.4f test_acc=%.4f"
              % (rank, step, all_losses[0], all_losses[-1], float(np.mean(all_losses[:k])),
                 float(np.mean(all_losses[-k:])), acc), flush=True)
        worker.barrier()  # nobody leaves while another still needs the servers
    return 0


if __name__ == "__main__":
    sys.exit(main())
