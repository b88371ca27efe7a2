#!/usr/bin/env bash
# bench/rdma/run.sh [ember-bench-rdma args...] (what `scripts/bench.sh rdma`
# runs): builds ember-bench-rdma for the Soft-RoCE guest (build/rdma-guest,
# -O2 -march=x86-64-v2) and runs it there, rdma beside tcp in the same
# guest. Prints the benchmark's table; the last line is its SUMMARY. When
# the guest cannot run here it says why and prints "SUMMARY rdma_available=0".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
if ! reason=$(scripts/rdma-vm/image.sh --check 2>&1); then
  echo "ember-bench-rdma: the Soft-RoCE guest cannot run here: $reason"
  echo "SUMMARY rdma_available=0"
  exit 0
fi
scripts/rdma-vm/suite.sh --configure-only || exit 1
cmake -S . -B build/rdma-guest -DEMBER_BUILD_BENCH=ON >/dev/null || exit 1
out=$(mktemp)
if ! cmake --build build/rdma-guest -j "$(nproc)" --target ember-bench-rdma > "$out" 2>&1; then
  tail -n 30 "$out"
  rm -f "$out"
  exit 1
fi
scripts/rdma-vm/run.sh --mem 2G --timeout 900 -- build/rdma-guest/bench/rdma/ember-bench-rdma "$@" > "$out" 2>&1
rc=$?
sed -n '/^ember-bench-rdma/,/^SUMMARY/p' "$out" | grep -v '^\[[ 0-9.]*\]'
if ! grep -q '^SUMMARY' "$out"; then
  tail -n 20 "$out"
  echo "SUMMARY rdma_available=1 failed=1"
  rm -f "$out"
  exit "$((rc == 0 ? 1 : rc))"
fi
rm -f "$out"
exit "$rc"
