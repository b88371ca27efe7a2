#!/usr/bin/env bash
# Tests scripts/bench.sh's usage text and name check (before anything is
# installed or built): the names listed are exactly bench/'s directories with
# a CMakeLists.txt, and anything else (a file such as README.md, a path) is
# refused with exit code 2 and that list.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bench="$root/scripts/bench.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }

want=()
for d in "$root"/bench/*/; do [[ -f $d/CMakeLists.txt ]] && want+=("$(basename "$d")"); done
((${#want[@]} > 0)) || fail "no benchmark directories under $root/bench"
want_text="NAME is one of: ${want[*]}"

out=$("$bench" --help) || fail "--help exited non-zero"
[[ $out == *"$want_text"$'\n'* ]] || fail "--help does not list exactly '${want[*]}': $out"
[[ $out != *README* ]] || fail "--help lists a file that is not a benchmark: $out"

for bad in README.md CMakeLists.txt ../bench no-such-bench; do
  set +e
  out=$("$bench" "$bad" 2>&1)
  rc=$?
  set -e
  [[ $rc == 2 ]] || fail "bench.sh $bad: exit code $rc, expected 2 (output: $out)"
  [[ $out == *"no benchmark '$bad'; have: ${want[*]}" ]] || fail "bench.sh $bad: message '$out'"
done
set +e
"$bench" >/dev/null 2>&1
rc=$?
set -e
[[ $rc == 2 ]] || fail "bench.sh without a name: exit code $rc, expected 2"
echo "bench_args: OK"
