#!/usr/bin/env bash
# Builds the rdma test programs and runs every ctest labelled `rdma` inside
# the Soft-RoCE guest (run.sh). Called at the end of scripts/test.sh.
#
#   scripts/rdma-vm/suite.sh [--no-build] [--timeout SECS] [-- CTEST_ARGS...]
#   scripts/rdma-vm/suite.sh --configure-only   (bench/rdma/run.sh: just the build dir)
#
# The guest programs are built in build/rdma-guest (RelWithDebInfo,
# -O2 -march=x86-64-v2: optimised, because the guest is emulated, and no CPU
# feature the emulated CPU lacks), only the targets the rdma tests need.
# Warnings are not errors there: the dev build of scripts/test.sh enforces
# -Werror on the same sources, and g++ -O2 adds false positives
# (-Wnull-dereference inside libstdc++).
# When the guest cannot run here (no qemu, no kernel package, a build
# without rdma-core) it prints one line "RDMA suite skipped: <reason>" and
# exits 0. Otherwise it prints the guest's ctest result and the line
#   RDMA suite (Soft-RoCE guest): <p> passed, <f> failed, <s> skipped of <n> tests in <t> s
# and exits with ctest's status (98: the guest gave no result).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BUILD=$REPO/build/rdma-guest
build=1; timeout_s=600; configure_only=0
while (($#)); do
  case "$1" in
    --no-build) build=0; shift ;;
    --configure-only) configure_only=1; shift ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "rdma-vm/suite.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$REPO" || exit 2

if ! reason=$("$HERE/image.sh" --check 2>&1); then
  echo "RDMA suite skipped: the Soft-RoCE guest cannot run here: $reason"
  exit 0
fi
if ! pkg-config --exists libibverbs librdmacm 2>/dev/null; then
  echo "RDMA suite skipped: rdma-core development files are missing (libibverbs-dev, librdmacm-dev)"
  exit 0
fi

# The targets behind the `rdma` tests (add new ones here).
TARGETS=(rdma_transport_test rdma_test_peer ember-server fmnist-worker)
if ((build || configure_only)) && [[ ! -f $BUILD/build.ninja ]]; then
  cmake -S "$REPO" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="-O2 -march=x86-64-v2" -DEMBER_WERROR=OFF -DEMBER_WITH_CUDA=OFF \
    -DEMBER_WITH_RDMA=ON >/dev/null || exit 1
fi
((configure_only)) && exit 0
if ((build)); then
  echo "rdma-vm: building ${TARGETS[*]} in $BUILD"
  cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}" || exit 1
fi

start=$(date +%s)
out=$(mktemp)
"$HERE/run.sh" --mem 3G --timeout "$timeout_s" -- \
  ctest --test-dir "$BUILD" -L rdma --output-on-failure --timeout 240 "$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
elapsed=$(($(date +%s) - start))
# ctest: "100% tests passed, 0 tests failed out of 17"; skips are listed as
# "The following tests did not run:" lines ending in "(Skipped)".
total=$(sed -n 's/.*tests passed, [0-9]* tests* failed out of \([0-9]*\).*/\1/p' "$out" | tail -n1)
failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests* failed out of.*/\1/p' "$out" | tail -n1)
skipped=$(grep -c '(Skipped)' "$out")
rm -f "$out"
if [[ -z $total ]]; then
  echo "RDMA suite (Soft-RoCE guest): no ctest result (exit status $rc) after ${elapsed} s"
  exit $((rc == 0 ? 98 : rc))
fi
echo "RDMA suite (Soft-RoCE guest): $((total - failed - skipped)) passed, $failed failed, $skipped skipped of $total tests in ${elapsed} s"
exit "$rc"
