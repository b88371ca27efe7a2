#!/usr/bin/env bash
# Tests scripts/demo.sh's flow around the real programs, in a copy of the
# scripts with stand-ins for cmake, ember-server and fmnist-worker (the real
# job is the demo itself; this checks what it does around it):
#  - the first-build note is printed only while build/release has no
#    ember-server; a failed build whose log has no error line still ends in
#    "FAILED: the build failed" with the log's last lines;
#  - a worker that fails ends the demo with exit code 1 and its error line in
#    the FAILED line, not only in the log excerpts before it;
#  - SIGINT to the demo's process group while the workers run (started the
#    way a script does it, `setsid scripts/demo.sh &`, which leaves SIGINT
#    ignored on entry) says "interrupted", stops the server and the workers,
#    shows no failure and exits 130.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
demo_pid=""
cleanup() {
  if [[ -n $demo_pid ]]; then kill -KILL -- "-$demo_pid" 2>/dev/null || true; fi
  for f in "$tmp"/pids/*; do [[ -f $f ]] && { kill -KILL "$(cat "$f")" 2>/dev/null || true; }; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# A tree with the demo's scripts and config; build/release is empty.
make_tree() {  # make_tree DIR
  mkdir -p "$1/scripts" "$1/config"
  cp "$root/scripts/demo.sh" "$root/scripts/launch_workers.sh" "$1/scripts/"
  cp "$root/config/ember.toml" "$1/config/"
}
mkdir -p "$tmp/pids" "$tmp/bin-build-fails" "$tmp/bin-ok"
# cmake whose build fails without an error line (as an interrupted ninja).
cat >"$tmp/bin-build-fails/cmake" <<'EOF'
#!/bin/sh
[ "$1" = --build ] || exit 0
echo "ninja: build stopped: interrupted by user."
exit 1
EOF
printf '#!/bin/sh\nexit 0\n' >"$tmp/bin-ok/cmake"
chmod +x "$tmp"/bin-*/cmake

# First run, failed build.
make_tree "$tmp/fresh"
set +e
out=$(cd "$tmp" && PATH="$tmp/bin-build-fails:$PATH" EMBER_SKIP_DEPS=1 TMPDIR="$tmp" fresh/scripts/demo.sh 2>&1)
rc=$?
set -e
[[ $rc == 1 ]] || fail "failed build: exit code $rc, expected 1: $out"
[[ $out == *"fmnist-baseline (first time: about 4 minutes on 2 idle cores)"* ]] \
  || fail "no first-build note without build/release/server/ember-server: $out"
[[ $out == *"ninja: build stopped: interrupted by user."* ]] || fail "the build log's last lines are not shown: $out"
[[ $out == *"demo: FAILED: the build failed"* ]] || fail "no failure message for the build: $out"

# Built tree: stand-ins for the three programs. Each long-running one writes
# its pid under $EMBER_TEST_PIDS and runs until it is terminated.
tree=$tmp/built
make_tree "$tree"
mkdir -p "$tree/build/release/server" "$tree/build/release/examples/fashion_mnist"
cat >"$tree/build/release/server/ember-server" <<'EOF'
#!/usr/bin/env bash
for a; do [[ $a == --print-config ]] && { echo "# run config"; exit 0; }; done
echo "$$" >"$EMBER_TEST_PIDS/server"
sleep 300 &
child=$!
trap 'kill "$child"; exit 0' TERM
echo "ember-server ready listen=127.0.0.1:1 metrics="
wait "$child"
EOF
cat >"$tree/build/release/examples/fashion_mnist/fmnist-worker" <<'EOF'
#!/bin/sh
echo "progress epoch=1 step=1/10 loss=2.3"
if [ "$EMBER_WORKER_RANK" = "${EMBER_TEST_FAILING_RANK:-}" ]; then
  echo "fmnist-worker rank $EMBER_WORKER_RANK: error: training diverged: the loss is -nan at epoch 1 step 2; lower the learning rate" >&2
  exit 1
fi
echo "$$" >"$EMBER_TEST_PIDS/worker-$EMBER_WORKER_RANK"
exec sleep 300
EOF
printf '#!/bin/sh\nexit 1\n' >"$tree/build/release/examples/fashion_mnist/fmnist-baseline"
chmod +x "$tree"/build/release/server/ember-server "$tree"/build/release/examples/fashion_mnist/*

# A failing worker: its error is the reason given in the last line.
set +e
out=$(PATH="$tmp/bin-ok:$PATH" EMBER_SKIP_DEPS=1 EMBER_TEST_PIDS="$tmp/pids" TMPDIR="$tmp" \
  EMBER_TEST_FAILING_RANK=1 timeout 60 "$tree/scripts/demo.sh" --workers 2 --epochs 1 2>&1)
rc=$?
set -e
[[ $rc == 1 ]] || fail "failing worker: exit code $rc, expected 1: $out"
want="demo: FAILED: a worker failed (exit code 1): fmnist-worker rank 1: error: training diverged"
grep -q -F -- "$want" <<<"$out" || fail "the FAILED line does not give the worker's error: $out"
for f in server worker-0; do
  ! kill -0 "$(cat "$tmp/pids/$f")" 2>/dev/null || fail "$f survived the failed demo"
done
rm -f "$tmp"/pids/*

# Started as a script starts a job: a simple command with `&` and no job
# control ignores SIGINT (a subshell `( ... ) &` would not).
PATH="$tmp/bin-ok:$PATH" EMBER_SKIP_DEPS=1 EMBER_TEST_PIDS="$tmp/pids" TMPDIR="$tmp" \
  setsid "$tree/scripts/demo.sh" --workers 2 --epochs 1 >"$tmp/out" 2>&1 &
demo_pid=$!
deadline=$((SECONDS + 30))
until [[ -s $tmp/pids/server && -s $tmp/pids/worker-0 && -s $tmp/pids/worker-1 ]] \
      && grep -q "^==> training" "$tmp/out"; do
  kill -0 "$demo_pid" 2>/dev/null || fail "the demo exited before its workers ran: $(cat "$tmp/out")"
  ((SECONDS < deadline)) || fail "the workers did not start within 30 s: $(cat "$tmp/out")"
  sleep 0.1
done
pgid=$(ps -o pgid= -p "$demo_pid" | tr -d ' ')
[[ $pgid == "$demo_pid" ]] || fail "setsid did not make the demo a process group leader (pgid $pgid)"
! grep -q 'first time' "$tmp/out" \
  || fail "first-build note although build/release/server/ember-server exists: $(cat "$tmp/out")"
kill -INT -- "-$demo_pid"
running() { local st; st=$(ps -o stat= -p "$1") && [[ $st != Z* ]]; }  # a zombie has exited
deadline=$((SECONDS + 20))
while running "$demo_pid"; do
  ((SECONDS < deadline)) || fail "the demo still runs 20 s after SIGINT: $(cat "$tmp/out")"
  sleep 0.1
done
set +e
wait "$demo_pid"
rc=$?
set -e
demo_pid=""
out=$(cat "$tmp/out")
[[ $rc == 130 ]] || fail "interrupted demo: exit code $rc, expected 130: $out"
[[ $out == *"demo: interrupted (SIGINT)"* ]] || fail "no interruption message: $out"
[[ $out != *FAILED* && $out != *"---- last lines"* ]] || fail "the interruption is reported as a failure: $out"
for f in server worker-0 worker-1; do
  ! kill -0 "$(cat "$tmp/pids/$f")" 2>/dev/null || fail "$f survived the interrupted demo"
done
echo "demo_flow: OK"
