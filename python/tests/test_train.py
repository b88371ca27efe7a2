"""python/examples/train_fmnist.py: a short run (two worker processes, a few
dozen steps each) on the real Fashion-MNIST data through a real ember-server;
the loss must fall and the test accuracy rise above chance; --help and a
missing libember.so before it is built."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

EXAMPLE = os.path.join(REPO, "python", "examples", "train_fmnist.py")
DATA = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


@pytest.mark.skipif(not os.path.exists(DATA),
                    reason="Fashion-MNIST not installed (Debian package dataset-fashion-mnist)")
def test_two_workers_train_and_the_loss_falls(start_server):
    s = start_server(num_workers=2, optimizer="momentum", learning_rate=0.05)
    procs = [subprocess.Popen(
        [sys.executable, EXAMPLE, "--config", s.config_path, "--rank", str(r),
         "--epochs", "1", "--max-steps", "60", "--batch-size", "64", "--hidden", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=90)
        outs.append(out)
        assert p.returncode == 0, out
    for rank, out in enumerate(outs):
        m = re.search(r"^done rank=(\d+) steps=(\d+) first_loss=\S+ last_loss=\S+ "
                      r"first_mean=(\S+) last_mean=(\S+) test_acc=(\S+)$", out, re.M)
        assert m, out
        assert int(m.group(1)) == rank
        assert int(m.group(2)) == 60
        first, last, acc = float(m.group(3)), float(m.group(4)), float(m.group(5))
        assert last < 0.75 * first, out  # starts near ln(10) = 2.3
        assert acc > 0.6, out  # chance is 0.1
        assert re.search(r"^epoch 1 rank %d loss \S+ test_acc \S+ samples/s \S+ comm_share \S+$"
                         % rank, out, re.M), out
    # BSP: both ranks end with the same parameters, hence the same accuracy.
    accs = [re.search(r"test_acc=(\S+)", o).group(1) for o in outs]
    assert accs[0] == accs[1]


def test_missing_data_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, EXAMPLE, "--config", "unused.toml",
                          "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "dataset-fashion-mnist" in out.stderr
    assert str(tmp_path) in out.stderr


def test_help_works_without_the_library(tmp_path):
    env = dict(os.environ, EMBER_LIB=str(tmp_path / "libember.so.0"))
    out = subprocess.run([sys.executable, EXAMPLE, "--help"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout


def test_missing_library_is_a_clear_error(tmp_path):
    env = dict(os.environ, EMBER_LIB=str(tmp_path / "libember.so.0"))
    out = subprocess.run([sys.executable, EXAMPLE, "--config", "unused.toml"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "train_fmnist: ember: cannot load libember.so" in out.stderr
    assert "cmake --build build/release --target ember_capi" in out.stderr
    assert "Traceback" not in out.stderr
