#!/usr/bin/env bash
# lttng_sched.sh: an LTTng kernel trace of scheduler switches and wake-ups
# (sched_switch, sched_wakeup, sched_migrate_task) while a command runs, or
# for a fixed time — to see comm threads being preempted, migrated or kept
# waiting (Ember pins I/O threads with [communication] cpu_affinity and
# shard threads with [server] shard_cpu_affinity).
#
#   sudo scripts/profile/lttng_sched.sh [-o DIR] -- CMD [ARGS...]
#   sudo scripts/profile/lttng_sched.sh [-o DIR] -d SECONDS
#
#   -o, --out DIR        trace directory (default ./lttng-ember-<time>)
#   -d, --duration SECS  trace the whole system for this long instead of a command
#   -h, --help           this text
#
# Read the trace with babeltrace2 DIR | grep ember-  (Debian babeltrace2), or
# open it in Trace Compass. Needs Debian's lttng-tools and lttng-modules-dkms
# (kernel tracer) and root; the session is destroyed on exit, the trace kept.
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
out=""; duration=""
while (($#)); do
  case "$1" in
    -o|--out) out="$2"; shift 2 ;;
    -d|--duration) duration="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "lttng_sched: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z $duration && $# -eq 0 ]]; then usage >&2; exit 2; fi
[[ -z $duration || $duration =~ ^[1-9][0-9]*$ ]] || { echo "lttng_sched: --duration must be whole seconds" >&2; exit 2; }
command -v lttng >/dev/null || { echo "lttng_sched: lttng is missing (apt-get install lttng-tools lttng-modules-dkms)" >&2; exit 1; }
session="ember-sched-$$"
out=${out:-"$PWD/lttng-ember-$(date +%Y%m%d-%H%M%S)"}
cleanup() { lttng destroy "$session" >/dev/null 2>&1 || true; }
trap cleanup EXIT
lttng create "$session" --output="$out" >/dev/null
lttng enable-event --kernel --session="$session" sched_switch,sched_wakeup,sched_migrate_task >/dev/null
lttng add-context --kernel --session="$session" --type=tid --type=procname >/dev/null
lttng start "$session" >/dev/null
echo "lttng_sched: tracing into $out" >&2
rc=0
if [[ -n $duration ]]; then
  sleep "$duration"
else
  "$@" || rc=$?
fi
lttng stop "$session" >/dev/null
echo "lttng_sched: trace in $out; read it with: babeltrace2 $out | grep -E 'ember-|comm'" >&2
exit "$rc"
