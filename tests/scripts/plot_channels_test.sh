#!/usr/bin/env bash
# Tests scripts/plot_channels.py on a recorded run: record_ring_run (real
# MpscRings with the Recorder hooked in) writes a recording, the script
# renders it, and each PNG must exist, carry the PNG signature, decode with
# matplotlib to a non-trivial image, and the hot rank (rank 0 sends 4x) must
# be reported. Also: a malformed recording is refused with exit 1 and the
# line named.
#   plot_channels_test.sh RECORD_RING_RUN_BINARY
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
run_bin=$1
py=/usr/bin/python3
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$run_bin" "$tmp/run.rec" --channels 4 --ranks 4 --messages 3000 --seed 7 >/dev/null \
  || fail "record_ring_run failed"
head -1 "$tmp/run.rec" | grep -qx "ember-record 1" || fail "recording has no magic line"
tail -1 "$tmp/run.rec" | grep -q "^end " || fail "recording has no end line"

out=$("$py" "$root/scripts/plot_channels.py" "$tmp/run.rec" --out "$tmp/png" --prefix run-) \
  || fail "plot_channels.py failed: $out"
for k in channels sizes ranks; do
  f="$tmp/png/run-$k.png"
  [[ -s $f ]] || fail "$f missing or empty"
  [[ $(head -c 8 "$f" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || fail "$f is not a PNG"
done
"$py" - "$tmp/png" <<'PY' || fail "PNG decode check"
import sys, matplotlib
matplotlib.use("Agg")
import matplotlib.image as mpimg
for k in ("channels", "sizes", "ranks"):
    img = mpimg.imread(f"{sys.argv[1]}/run-{k}.png")
    h, w = img.shape[:2]
    assert h >= 200 and w >= 300, (k, img.shape)
    # Something was drawn: not a single flat colour.
    assert img[..., :3].std() > 0.01, (k, "blank image")
PY
[[ $out == *"hot ranks (over twice the mean bytes): 0"* ]] || fail "hot rank 0 not reported: $out"

printf 'ember-record 1\nsource x\nstart_unix_ns 0\nchannels 1\nranks 1\nsample_interval_ns 1\ndata\nc 0 3 0 0 0 0\n' >"$tmp/bad.rec"
set +e
msg=$("$py" "$root/scripts/plot_channels.py" "$tmp/bad.rec" --out "$tmp/bad" 2>&1)
rc=$?
set -e
[[ $rc == 1 ]] || fail "malformed recording: exit $rc, want 1"
[[ $msg == *"bad.rec:8: id 3 outside 0 .. 0"* ]] || fail "malformed recording message: $msg"
[[ ! -e $tmp/bad/channels.png ]] || fail "PNG written for a malformed recording"
echo "plot_channels_test: ok"
