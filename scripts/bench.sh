#!/usr/bin/env bash
# scripts/bench.sh NAME [args...]: builds the release preset if needed and
# runs benchmark NAME (ring, pool, wire, transport, pushpull, train, gpu, rdma).
# A benchmark with a driver script (bench/NAME/run.sh) runs through it;
# otherwise the binary build/release/bench/NAME/ember-bench-NAME runs.
# The last line of output is `SUMMARY key=value ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The benchmarks: bench/'s directories with a CMakeLists.txt (what
# bench/CMakeLists.txt adds), not its README.md or other files.
names() {
  local d found=()
  for d in bench/*/; do [[ -f $d/CMakeLists.txt ]] && found+=("$(basename "$d")"); done
  echo "${found[*]}"
}
usage() {
  echo "usage: scripts/bench.sh NAME [args...]; NAME is one of: $(names)"
  echo "  scripts/bench.sh NAME --help: the benchmark's own options"
}
if (($# < 1)); then usage >&2; exit 2; fi
if [[ $1 == -h || $1 == --help ]]; then sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; usage; exit 0; fi
name="$1"; shift
if [[ ! $name =~ ^[A-Za-z0-9_-]+$ || ! -f bench/$name/CMakeLists.txt ]]; then
  echo "bench.sh: no benchmark '$name'; have: $(names)" >&2
  exit 2
fi
[[ ${EMBER_SKIP_DEPS:-0} == 1 ]] || scripts/install-deps.sh >/dev/null
cmake --preset release >/dev/null
if [[ -x bench/$name/run.sh ]]; then
  cmake --build build/release -j "$(nproc)"
  exec bench/"$name"/run.sh "$@"
fi
cmake --build build/release -j "$(nproc)" --target "ember-bench-$name"
exec "build/release/bench/$name/ember-bench-$name" "$@"
