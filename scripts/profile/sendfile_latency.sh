#!/usr/bin/env bash
# sendfile_latency.sh: runs sendfile_latency.bt (bpftrace) for Ember's
# zero_copy = "sendfile" path: a histogram of sendfile(2) latency in
# microseconds, of bytes per call, and a count per errno of failed calls.
#
#   sudo scripts/profile/sendfile_latency.sh [-p PID] [-d SECONDS]
#
#   -p, --pid PID        only this process (default: every process)
#   -d, --duration SECS  stop after this long (default: until Ctrl-C)
#   -h, --help           this text
#
# Needs Debian's bpftrace and root (or CAP_BPF + CAP_PERFMON). Long tails in
# the latency histogram with a full send queue point at a slow receiver
# (docs/troubleshooting.md, "throughput drops").
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
pid=0; duration=""
while (($#)); do
  case "$1" in
    -p|--pid) pid="$2"; shift 2 ;;
    -d|--duration) duration="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "sendfile_latency: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $pid =~ ^[0-9]+$ ]] || { echo "sendfile_latency: --pid must be a number" >&2; exit 2; }
[[ -z $duration || $duration =~ ^[1-9][0-9]*$ ]] || { echo "sendfile_latency: --duration must be whole seconds" >&2; exit 2; }
command -v bpftrace >/dev/null || { echo "sendfile_latency: bpftrace is missing (apt-get install bpftrace)" >&2; exit 1; }
script="$(dirname "$0")/sendfile_latency.bt"
if [[ -n $duration ]]; then
  exec timeout -s INT "$duration" bpftrace "$script" "$pid"
fi
exec bpftrace "$script" "$pid"
