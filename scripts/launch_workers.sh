#!/usr/bin/env bash
# Starts N worker processes, each pinned with taskset, one log file each;
# stops them all on Ctrl-C/SIGTERM; exits with the first failure's exit code
# (0 when all succeed).
#
#   scripts/launch_workers.sh --workers N [--cores LIST] [--log-dir DIR] -- CMD [ARGS...]
#
# In CMD and ARGS, the text {rank} is replaced by the worker rank (0..N-1);
# each worker also gets EMBER_WORKER_RANK and EMBER_NUM_WORKERS in its
# environment. --cores is a comma-separated list of core lists, one per
# worker, separated by ':' (e.g. "0:1" or "0,1:2,3"); without it, worker r is
# pinned round-robin to core r mod nproc. A core that does not exist is an
# error before anything starts.
set -uo pipefail

workers=""; cores=""; log_dir="${TMPDIR:-/tmp}/ember-workers"
while (($#)); do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --cores) cores="$2"; shift 2 ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "launch_workers: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z $workers || ! $workers =~ ^[1-9][0-9]*$ ]]; then
  echo "launch_workers: --workers N (N >= 1) is required" >&2; exit 2
fi
if (($# == 0)); then echo "launch_workers: no command after --" >&2; exit 2; fi
ncpu=$(nproc --all)
IFS=':' read -r -a core_lists <<<"$cores"
if [[ -n $cores && ${#core_lists[@]} -ne $workers ]]; then
  echo "launch_workers: --cores has ${#core_lists[@]} lists for $workers workers" >&2; exit 2
fi
for ((r = 0; r < workers; r++)); do
  list=${core_lists[r]:-$((r % ncpu))}
  for c in ${list//,/ }; do
    if [[ ! $c =~ ^[0-9]+$ ]] || ((c >= ncpu)); then
      echo "launch_workers: core '$c' for worker $r does not exist (this machine has cores 0-$((ncpu - 1)))" >&2
      exit 2
    fi
  done
done
mkdir -p "$log_dir"

pids=()
stop_all() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
}
trap 'echo "launch_workers: stopping ${#pids[@]} workers" >&2; stop_all; wait; exit 130' INT TERM

for ((r = 0; r < workers; r++)); do
  list=${core_lists[r]:-$((r % ncpu))}
  cmd=()
  for a in "$@"; do cmd+=("${a//\{rank\}/$r}"); done
  EMBER_WORKER_RANK=$r EMBER_NUM_WORKERS=$workers \
    taskset -c "$list" "${cmd[@]}" >"$log_dir/worker-$r.log" 2>&1 &
  pids+=($!)
  echo "launch_workers: worker $r pid $! on cores $list, log $log_dir/worker-$r.log" >&2
done

first_rc=0
remaining=${#pids[@]}
declare -A done_pid=()
# A worker's exit: the first failure stops the others.
finished_with() {  # finished_with PID RC
  done_pid[$1]=1
  remaining=$((remaining - 1))
  if (($2 != 0 && first_rc == 0)); then
    first_rc=$2
    for ((r = 0; r < workers; r++)); do
      if [[ ${pids[r]} == "$1" ]]; then
        echo "launch_workers: worker $r failed with exit code $2; see $log_dir/worker-$r.log; stopping the others" >&2
      fi
    done
    stop_all
  fi
}
while ((remaining > 0)); do
  finished=
  wait -n -p finished "${pids[@]}" 2>/dev/null
  rc=$?
  if [[ -z ${finished:-} ]]; then
    # 127: none of them is left for wait -n (bash reaps workers that die
    # together, as after stop_all, on its own): collect each worker not yet
    # counted with a plain wait, which returns its saved status.
    if ((rc == 127)); then
      for p in "${pids[@]}"; do
        [[ -n ${done_pid[$p]:-} ]] && continue
        wait "$p" 2>/dev/null
        finished_with "$p" $?
      done
    fi
    continue
  fi
  [[ -n ${done_pid[$finished]:-} ]] && continue
  finished_with "$finished" "$rc"
  # Workers that died meanwhile may have been reaped with this one, and
  # wait -n never reports those: a worker that is gone is collected now (a
  # plain wait returns its saved status), so its failure still stops the
  # others.
  for p in "${pids[@]}"; do
    [[ -n ${done_pid[$p]:-} ]] && continue
    kill -0 "$p" 2>/dev/null && continue
    wait "$p" 2>/dev/null
    finished_with "$p" $?
  done
done
exit "$first_rc"
