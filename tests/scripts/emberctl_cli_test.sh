#!/usr/bin/env bash
# emberctl without a server: `tune` on given numbers prints exactly what the
# formula gives (optimal_buffer_size = max(RTT x bandwidth, workers x average
# message x 2), computed here again in awk) and the derived values; tune
# --probe against `emberctl probe-sink`; `config check` on a good and a bad
# file (exit codes, file:line); `record` on a recorded run; usage errors.
#   emberctl_cli_test.sh EMBERCTL RECORD_RING_RUN
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
ctl=$1
run_bin=$2
tmp=$(mktemp -d)
sink_pid=""
cleanup() { [[ -n $sink_pid ]] && kill "$sink_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# tune on given numbers: 200 us x 25 Gbit/s = 625000 B; 16 x 128 KiB x 2 = 4194304 B.
out=$("$ctl" tune --rtt 200us --bandwidth 25Gbit --workers 16 --avg-message-size 128KB --channels 4)
bdp=$(awk 'BEGIN { printf "%d", 200e-6 * 25e9 / 8 }')
dbl=$((16 * 131072 * 2))
opt=$((bdp > dbl ? bdp : dbl))
[[ $out == *"= $bdp bytes"* ]] || fail "tune: RTT x bandwidth is not $bdp: $out"
[[ $out == *"x 2 = $dbl bytes"* ]] || fail "tune: workers term is not $dbl: $out"
[[ $out == *"optimal_buffer_size = max(RTT x bandwidth, workers x average message x 2) = $opt bytes"* ]] \
  || fail "tune: optimal_buffer_size is not $opt: $out"
# Derived, per tools/emberctl/tune.h: window per channel 1048576 B -> 8 messages
# -> 8 slots; batch = floor_pow2(1048576/4) = 256 KiB; 128 KiB messages are
# below it: 8 x 128 KiB / 256 KiB = 4 batch blocks of 256 KiB, x 4 channels x 2
# = 8 MiB; floor 2 x 4 x 4 MiB = 32 MiB -> 16 pages.
[[ $out == *$'[communication]\nbatch_threshold = "256KB"\nring_buffer_size = 8\nprealloc_pages = 16'* ]] \
  || fail "tune: recommendation: $out"

set +e
"$ctl" tune --rtt 50us --workers 2 --avg-message-size 4KB >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] && grep -q -- "--bandwidth" "$tmp/err" || fail "tune without bandwidth: rc=$rc $(cat "$tmp/err")"
set +e
"$ctl" tune --rtt 50us --bandwidth 10Gb --workers 2 --avg-message-size 4KB >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] && grep -q "10Gbit" "$tmp/err" || fail "tune with a bad bandwidth unit: rc=$rc"

# A timeout under 1 ms would become 0 ms, which sockets read as no timeout.
set +e
"$ctl" tune --probe 127.0.0.1:1 --workers 2 --avg-message-size 4KB --timeout 500us >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] && grep -q -- "--timeout must be at least 1ms" "$tmp/err" \
  || fail "tune --timeout 500us: rc=$rc $(cat "$tmp/err")"
# A missing argument is reported before a probe runs (exit 2, not the probe's
# failure against a port where nothing listens).
set +e
"$ctl" tune --probe 127.0.0.1:1 --workers 2 >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] && grep -q -- "--avg-message-size" "$tmp/err" \
  || fail "tune --probe without --avg-message-size: rc=$rc $(cat "$tmp/err")"
# tune --probe against a sink on loopback.
mkfifo "$tmp/sink.fifo"
"$ctl" probe-sink --listen 127.0.0.1:0 --clients 1 >"$tmp/sink.fifo" 2>"$tmp/sink.err" &
sink_pid=$!
exec 3<"$tmp/sink.fifo"
line=""
read -r -t 20 line <&3 || fail "probe-sink printed nothing in 20 s: $(cat "$tmp/sink.err")"
addr=${line#emberctl probe-sink listening on }
[[ $addr != "$line" ]] || addr=""
[[ -n $addr ]] || fail "probe-sink printed no address"
out=$("$ctl" tune --probe "$addr" --pings 20 --probe-duration 100ms --workers 2 --avg-message-size 4KB) \
  || fail "tune --probe failed"
[[ $out == *"measured: RTT "*"bandwidth "* && $out == *"recommended:"* ]] || fail "tune --probe: $out"
# The bulk transfer is sized from a warm-up's rate: the plan says so, and the
# measured line gives the time the transfer really took.
[[ $out == *"then a bulk transfer sized to take about "*" (--probe-duration) at a warm-up's rate"* ]] \
  || fail "tune --probe: the planned transfer is not labelled as a plan: $out"
[[ $out =~ bandwidth\ [^\(]*\([^\)]*\)\ \([^\)]*\ sent\ in\ [0-9.]+\ (us|ms|s)\) ]] \
  || fail "tune --probe: no measured transfer time: $out"
wait "$sink_pid" || fail "probe-sink exited non-zero after its one client"
sink_pid=""
exec 3<&-

# config check.
out=$("$ctl" config check "$root/config/ember.toml") || fail "config check of config/ember.toml"
[[ $out == *"config/ember.toml: valid"* ]] || fail "config check output: $out"
printf '[communication]\nbatch_threshold = "4XB"\n' >"$tmp/bad.toml"
set +e
"$ctl" config check "$tmp/bad.toml" >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 1 ]] || fail "config check of a bad file: rc=$rc"
grep -q "bad.toml:2" "$tmp/err" || fail "config check names no file:line: $(cat "$tmp/err")"
grep -q "is NOT valid" "$tmp/err" || fail "config check verdict: $(cat "$tmp/err")"

# record summary of a recorded run.
"$run_bin" "$tmp/run.rec" --channels 2 --ranks 3 --messages 500 >/dev/null
out=$("$ctl" record "$tmp/run.rec") || fail "emberctl record"
[[ $out == *"recording of record_ring_run: 2 channel(s), 3 rank(s)"* ]] || fail "record: $out"
[[ $out == *"hot (over twice the mean)"* ]] || fail "record: hot rank 0 not marked: $out"

# usage errors.
set +e
"$ctl" >/dev/null 2>&1; rc=$?
"$ctl" status >/dev/null 2>"$tmp/err"; rc2=$?
set -e
[[ $rc == 2 ]] || fail "emberctl without a subcommand: rc=$rc, expected 2 (bad usage)"
[[ $rc2 == 2 ]] && grep -q -- "--config FILE" "$tmp/err" || fail "status without targets: rc=$rc2"
# A missing or misspelt command is named, with the list of commands.
set +e
"$ctl" >/dev/null 2>"$tmp/err"; rc=$?
set -e
grep -q "a command is needed:" "$tmp/err" && grep -q "emberctl status: servers up" "$tmp/err" \
  || fail "emberctl without a command does not list them: $(cat "$tmp/err")"
set +e
"$ctl" statsu >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] || fail "emberctl statsu: rc=$rc, expected 2"
grep -q "unknown command 'statsu'; the commands are:" "$tmp/err" && grep -q "emberctl stats: every metric" "$tmp/err" \
  || fail "a misspelt command is not named: $(cat "$tmp/err")"
# config without its subcommand names it.
set +e
"$ctl" config >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] || fail "config without a subcommand: rc=$rc, expected 2"
grep -q "config needs a subcommand" "$tmp/err" && grep -q "emberctl config check: validate a TOML config" "$tmp/err" \
  || fail "config without a subcommand does not name 'check': $(cat "$tmp/err")"
# A parse error CLI11 raises itself (a missing positional argument) is bad usage too.
set +e
"$ctl" config check >/dev/null 2>"$tmp/err"; rc=$?
set -e
[[ $rc == 2 ]] && grep -q "file" "$tmp/err" || fail "config check without a file: rc=$rc, expected 2: $(cat "$tmp/err")"
"$ctl" --help >/dev/null || fail "emberctl --help did not exit 0"
echo "emberctl_cli_test: ok"
