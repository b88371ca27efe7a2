#!/usr/bin/env bash
# flamegraph.sh: on-CPU flame graph of an Ember process (or any command).
#
#   scripts/profile/flamegraph.sh [options] -p PID            profile a running process
#   scripts/profile/flamegraph.sh [options] -- CMD [ARGS...]  profile a command to its end
#
# Options:
#   -o, --out FILE       output file (default: flamegraph.html, or .json / .svg per format)
#   -d, --duration SECS  with -p: how long to record (default 30)
#   -F, --freq HZ        sampling frequency (default 99: off the beat of 100 Hz timers)
#   --dwarf              DWARF call graphs (for binaries built without frame pointers;
#                        bigger perf.data); default: frame-pointer call graphs (-g)
#   --format FMT         html (default), json (stack tree, no template needed) or svg
#   --fetch-template     download the d3-flame-graph HTML template with npm into
#                        ~/.cache/ember/ and exit
#   -h, --help           this text
#
# How: `perf record -F 99 -g` (Debian linux-perf), then perf's own flame graph
# script (`perf script report flamegraph`, maintained in the Linux tree) fills
# the d3-flame-graph template (Netflix's d3-flame-graph, maintained on npm;
# Debian 12 ships no flame graph package). The template is looked up in
# $FLAMEGRAPH_TEMPLATE, /usr/share/d3-flame-graph/d3-flamegraph-base.html and
# ~/.cache/ember/d3-flame-graph/package/dist/templates/d3-flamegraph-base.html.
# --format svg uses Brendan Gregg's stackcollapse-perf.pl and flamegraph.pl
# when they are on PATH. Needs perf_event_paranoid <= 1 or root
# (sysctl kernel.perf_event_paranoid=1). Build Ember with
# -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS=-fno-omit-frame-pointer
# for readable stacks.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

out=""; duration=30; freq=99; callgraph=(-g); format=html; pid=""
d3_version=4.1.3
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ember/d3-flame-graph"
while (($#)); do
  case "$1" in
    -o|--out) out="$2"; shift 2 ;;
    -d|--duration) duration="$2"; shift 2 ;;
    -F|--freq) freq="$2"; shift 2 ;;
    --dwarf) callgraph=(--call-graph dwarf); shift ;;
    --format) format="$2"; shift 2 ;;
    -p|--pid) pid="$2"; shift 2 ;;
    --fetch-template)
      command -v npm >/dev/null || { echo "flamegraph: npm is missing (apt-get install npm)" >&2; exit 1; }
      mkdir -p "$cache"
      (cd "$cache" && npm pack --silent "d3-flame-graph@$d3_version" >/dev/null \
        && tar xzf "d3-flame-graph-$d3_version.tgz")
      echo "flamegraph: template in $cache/package/dist/templates/d3-flamegraph-base.html"
      exit 0 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "flamegraph: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z $pid && $# -eq 0 ]]; then usage >&2; exit 2; fi
[[ -n $pid && $# -gt 0 ]] && { echo "flamegraph: give -p PID or a command, not both" >&2; exit 2; }
[[ $freq =~ ^[1-9][0-9]*$ ]] || { echo "flamegraph: --freq must be a positive integer" >&2; exit 2; }
[[ $duration =~ ^[1-9][0-9]*$ ]] || { echo "flamegraph: --duration must be whole seconds > 0" >&2; exit 2; }
case "$format" in html|json|svg) ;; *) echo "flamegraph: --format must be html, json or svg" >&2; exit 2 ;; esac
command -v perf >/dev/null || { echo "flamegraph: perf is missing (apt-get install linux-perf)" >&2; exit 1; }

template=""
if [[ $format == html ]]; then
  for t in "${FLAMEGRAPH_TEMPLATE:-}" /usr/share/d3-flame-graph/d3-flamegraph-base.html \
           "$cache/package/dist/templates/d3-flamegraph-base.html"; do
    if [[ -n $t && -f $t ]]; then template=$t; break; fi
  done
  if [[ -z $template ]]; then
    echo "flamegraph: no d3-flame-graph template; run '$0 --fetch-template' once (npm), set" \
         "FLAMEGRAPH_TEMPLATE, or use --format json" >&2
    exit 1
  fi
fi
if [[ $format == svg ]] && ! command -v flamegraph.pl >/dev/null; then
  echo "flamegraph: --format svg needs flamegraph.pl and stackcollapse-perf.pl on PATH" >&2; exit 1
fi
[[ -n $out ]] || out="flamegraph.$format"

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
data="$work/perf.data"
if [[ -n $pid ]]; then
  echo "flamegraph: recording pid $pid at $freq Hz for $duration s" >&2
  perf record -F "$freq" "${callgraph[@]}" -o "$data" -p "$pid" -- sleep "$duration"
else
  echo "flamegraph: recording '$*' at $freq Hz" >&2
  perf record -F "$freq" "${callgraph[@]}" -o "$data" -- "$@"
fi
case "$format" in
  html) (cd "$work" && perf script -i "$data" report flamegraph --template "$template" -o "$work/out") ;;
  json) (cd "$work" && perf script -i "$data" report flamegraph --format json -o "$work/out") ;;
  svg) perf script -i "$data" | stackcollapse-perf.pl | flamegraph.pl >"$work/out" ;;
esac
mv "$work/out" "$out"
echo "flamegraph: wrote $out" >&2
