#!/usr/bin/env bash
# Tests scripts/launch_workers.sh: pinning, {rank} substitution, first failure's
# exit code, refusal of a core that does not exist, and stopping: SIGTERM to
# the launcher (what Ctrl-C does to a foreground job, as SIGINT) stops every
# worker and exits 130.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
lw="$root/scripts/launch_workers.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$lw" --workers 2 --cores "0:0" --log-dir "$tmp/a" -- \
  sh -c 'echo "rank={rank} env=$EMBER_WORKER_RANK of $EMBER_NUM_WORKERS"; taskset -pc $$' \
  || fail "two good workers returned non-zero"
grep -q "rank=0 env=0 of 2" "$tmp/a/worker-0.log" || fail "worker 0 log: $(cat "$tmp/a/worker-0.log")"
grep -q "rank=1 env=1 of 2" "$tmp/a/worker-1.log" || fail "worker 1 log"
grep -q "affinity list: 0$" "$tmp/a/worker-1.log" || fail "worker 1 not pinned to core 0: $(cat "$tmp/a/worker-1.log")"

set +e
"$lw" --workers 2 --log-dir "$tmp/b" -- sh -c 'if [ {rank} = 1 ]; then exit 7; fi; sleep 30'
rc=$?
set -e
[[ $rc == 7 ]] || fail "expected exit code 7 of the failing worker, got $rc"

# Workers that die together after a failure (stop_all) used to leave the
# launcher spinning on `wait -n` (127, nothing to report) in about half of
# the runs: each run must end, with the failure's code.
for i in $(seq 10); do
  set +e
  timeout 20 "$lw" --workers 4 --log-dir "$tmp/b$i" -- \
    sh -c 'if [ {rank} = 1 ]; then sleep 0.3; exit 3; fi; sleep 10' 2>/dev/null
  rc=$?
  set -e
  [[ $rc == 3 ]] || fail "run $i: expected exit code 3 after a worker failed, got $rc (124: hung)"
done

set +e
out=$("$lw" --workers 1 --cores "9999" --log-dir "$tmp/c" -- true 2>&1)
rc=$?
set -e
[[ $rc == 2 ]] || fail "nonexistent core accepted (rc=$rc)"
[[ $out == *"core '9999' for worker 0 does not exist"* ]] || fail "message: $out"
# Stop: two long-running workers pinned to core 0 announce themselves on a
# FIFO; the launcher is then terminated and must take both down with it.
mkfifo "$tmp/started"
"$lw" --workers 2 --cores "0:0" --log-dir "$tmp/d" -- \
  sh -c 'echo "$$" >"$0"; exec sleep 300' "$tmp/started" &
launcher=$!
exec 3<>"$tmp/started"  # read-write: no EOF between the two writers
read -r -t 20 pid_a <&3 || fail "first worker did not start"
read -r -t 20 pid_b <&3 || fail "second worker did not start"
exec 3<&-
kill -0 "$pid_a" && kill -0 "$pid_b" || fail "workers not running"
kill -TERM "$launcher"
set +e
wait "$launcher"
rc=$?
set -e
[[ $rc == 130 ]] || fail "terminated launcher exited $rc, want 130"
# The launcher waited for its children before exiting: both are gone now.
! kill -0 "$pid_a" 2>/dev/null || fail "worker $pid_a survived the launcher"
! kill -0 "$pid_b" 2>/dev/null || fail "worker $pid_b survived the launcher"
echo "launch_workers_test: ok"
