#!/usr/bin/env bash
# Tests scripts/demo.sh's argument checks: each bad option is refused with
# exit code 2 and a message naming it, before anything is installed or built.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
demo="$root/scripts/demo.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }

expect_refused() {  # expect_refused TEXT ARGS...: exit 2, TEXT in the message
  local text=$1; shift
  local out rc
  set +e
  out=$("$demo" "$@" 2>&1)
  rc=$?
  set -e
  [[ $rc == 2 ]] || fail "demo.sh $*: exit code $rc, expected 2 (output: $out)"
  [[ $out == *"$text"* ]] || fail "demo.sh $*: message '$out' lacks '$text'"
}

expect_refused "--epochs needs a value" --epochs
expect_refused "--transport needs a value" --workers 1 --transport
expect_refused "--workers must be a number from 1 to 256 (got '0')" --workers 0
expect_refused "--transport must be tcp or shm (got 'udp')" --transport udp
expect_refused "--mode must be bsp, asp or ssp" --mode sync
expect_refused "unknown argument '--gpus'" --gpus 2
# --option=value is --option value.
expect_refused "--transport must be tcp or shm (got 'udp')" --transport=udp
expect_refused "--workers must be a number from 1 to 256 (got '')" --workers=
expect_refused "unknown argument '--gpus'" --gpus=2
# 0 matches the number pattern; the servers would refuse it only after the build.
expect_refused "--lr must be a positive number below 1e300 (got '0')" --lr 0
expect_refused "--lr must be a positive number below 1e300 (got '0.0e5')" --lr 0.0e5
expect_refused "--lr must be a positive number below 1e300 (got '-0.1')" --lr -0.1
expect_refused "--seed must be a non-negative integer of at most 19 digits (got '-3')" --seed -3
expect_refused "--batch-size must be a number from 1 to 60000 (got '0')" --batch-size 0
expect_refused "(got --workers 2 x --batch-size 40000)" --workers 2 --batch-size 40000
# Values the workers would refuse only after the servers started (exit 1),
# and numbers that overflow bash's 64-bit arithmetic, exit 2 here.
expect_refused "--batch-size must be a number from 1 to 60000 (got '9223372036854775807')" --batch-size 9223372036854775807
expect_refused "--epochs must be a number from 1 to 10000 (got '10001')" --epochs 10001
expect_refused "--epochs must be a number from 1 to 10000 (got '99999999999999999999999')" --epochs 99999999999999999999999
expect_refused "--servers must be a number from 1 to 64 (got '100000')" --servers 100000
expect_refused "--lr must be a positive number below 1e300 (got '1e999')" --lr 1e999
expect_refused "--seed must be a non-negative integer of at most 19 digits" --seed 123456789012345678901
expect_refused "--keep-logs takes no value (got '--keep-logs=1')" --keep-logs=1
"$demo" --help | grep -q -- "--transport" || fail "--help does not list the options"
echo "demo_args: OK"
