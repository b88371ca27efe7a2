#!/usr/bin/env bash
# Ember's main job: data-parallel training of a Fashion-MNIST MLP
# (784-256-128-10) through ember-server, compared with the same model trained
# in one process without Ember.
#
#   scripts/demo.sh [--workers N] [--servers M] [--epochs E] [--transport tcp|shm]
#                   [--mode bsp|asp|ssp] [--batch-size B] [--seed S] [--lr LR]
#                   [--min-accuracy A] [--keep-logs]
#
# Steps: installs missing Debian packages (scripts/install-deps.sh; skipped
# with EMBER_SKIP_DEPS=1), builds the release preset's ember-server,
# fmnist-worker and fmnist-baseline, writes a run config derived from
# config/ember.toml (free ports on 127.0.0.1, N workers, M servers, transport,
# consistency, momentum SGD), starts the M servers and waits until each
# says it is ready, launches the N workers pinned to cores
# (scripts/launch_workers.sh), shows a progress bar per epoch from the
# workers' logs, stops the servers with SIGTERM (each must exit 0), trains the
# baseline (fmnist-baseline, batch N*B, same seed) and prints a final table.
#
# Defaults: 2 workers, 1 server, 3 epochs, shm (every process of the demo is
# on this host; --transport tcp runs the network path), bsp, batch 128 per worker,
# seed 1, momentum 0.9 and lr 0.05 — under asp and ssp 0.05 / N: there the
# server applies each worker's gradient on arrival instead of their average.
# The one-process baseline uses lr under bsp and N * lr under asp and ssp (0.05
# with the defaults), --lr included.
# Bounds: --workers 1..256, --servers 1..64, --epochs 1..10000, --batch-size
# 1..60000 with workers x batch-size <= 60000 (the training set), --seed below
# 10^19, --lr positive and below 1e300. Each worker and server pre-faults a
# 64 MiB page pool and takes a core's share: on 2 cores and 24 GiB, 48
# workers ran (22 s for one epoch); 256 did not (the pools alone are 16 GiB,
# and workers starting for seconds each missed the server's heartbeat
# timeout); the demo then stops with the failing worker's log.
# --min-accuracy is the test accuracy every worker must reach (default 0.85
# for bsp with >= 3 epochs, else 0.5, which only catches a diverged run).
# Exit status 0 when everything worked; non-zero when a step failed (build, a
# server, a worker, a server's exit status, the accuracy check); 2 for a bad
# option. Ctrl-C (SIGINT to the demo's process group) or SIGTERM stops
# everything and exits 130.
# Logs stay in the printed directory on failure, interruption or with --keep-logs.
set -euo pipefail
# A job started with `&` by a shell without job control (a script's
# `setsid scripts/demo.sh &`) inherits SIGINT ignored, and bash cannot trap a
# signal ignored on entry: the servers would take the SIGINT, the workers
# would fail and the demo would report that as a failure. When the demo leads
# its own process group, a SIGINT to that group is meant for it, so it runs
# again with SIGINT's default action and the trap below takes it. In a shared
# group the ignore is the parent's choice and stays.
sig_ignored=$(sed -n 's/^SigIgn:[[:space:]]*//p' "/proc/$$/status")
proc_stat=$(<"/proc/$$/stat"); proc_stat=${proc_stat##*) }
read -r _ _ pgid _ <<<"$proc_stat"   # fields after the command name: state ppid pgrp ...
if [[ -n $sig_ignored && $pgid == "$$" ]] && ((16#$sig_ignored & 2)); then
  exec env --default-signal=INT "$0" "$@"
fi
cd "$(dirname "$0")/.."
root=$(pwd)

workers=2; servers=1; epochs=3; transport=shm; mode=bsp; batch=128; seed=1
min_accuracy=""; keep_logs=0; lr=""
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
die() { echo "demo: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in --keep-logs=*|--help=*|-h=*) die "${1%%=*} takes no value (got '$1')" ;; esac
  # --option=value is --option value.
  if [[ $1 =~ ^(--[a-z-]+)=(.*)$ ]]; then
    set -- "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "${@:2}"
  fi
  case "$1" in
    --workers|--servers|--epochs|--transport|--mode|--batch-size|--seed|--min-accuracy|--lr)
      (($# >= 2)) || die "$1 needs a value (see --help)" ;;&
    --workers) workers="${2:-}"; shift 2 ;;
    --servers) servers="${2:-}"; shift 2 ;;
    --epochs) epochs="${2:-}"; shift 2 ;;
    --transport) transport="${2:-}"; shift 2 ;;
    --mode) mode="${2:-}"; shift 2 ;;
    --batch-size) batch="${2:-}"; shift 2 ;;
    --seed) seed="${2:-}"; shift 2 ;;
    --min-accuracy) min_accuracy="${2:-}"; shift 2 ;;
    --lr) lr="${2:-}"; shift 2 ;;
    --keep-logs) keep_logs=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
# Epochs and batch size are bounded as the workers bound them
# (examples/fashion_mnist/cli.h), checked here so that a bad value exits 2
# before any process starts; the server and worker counts are processes of
# this machine (each with its own page pool).
in_range() { [[ $1 =~ ^[1-9][0-9]*$ ]] && ((${#1} <= 6 && $1 <= $2)); }
in_range "$workers" 256 || die "--workers must be a number from 1 to 256 (got '$workers')"
in_range "$servers" 64 || die "--servers must be a number from 1 to 64 (got '$servers')"
in_range "$epochs" 10000 || die "--epochs must be a number from 1 to 10000 (got '$epochs')"
in_range "$batch" 60000 || die "--batch-size must be a number from 1 to 60000 (got '$batch')"
[[ $seed =~ ^[0-9]{1,19}$ ]] || die "--seed must be a non-negative integer of at most 19 digits (got '$seed')"
case "$transport" in tcp|shm) ;; *) die "--transport must be tcp or shm (got '$transport')" ;; esac
case "$mode" in bsp|asp|ssp) ;; *) die "--mode must be bsp, asp or ssp (got '$mode')" ;; esac
# Lengths first: the product of two long numbers would overflow bash's arithmetic.
if ((${#workers} > 5 || ${#batch} > 5 || workers * batch > 60000)); then
  die "--workers x --batch-size must be at most 60000, the training set (got --workers $workers x --batch-size $batch)"
fi
if [[ -z $min_accuracy ]]; then
  if [[ $mode == bsp ]] && ((epochs >= 3)); then min_accuracy=0.85; else min_accuracy=0.5; fi
fi
lr_default=0
if [[ -z $lr ]]; then
  lr_default=1
  if [[ $mode == bsp ]]; then lr=0.05; else lr=$(awk -v n="$workers" 'BEGIN { printf "%.6g", 0.05 / n }'); fi
fi
if [[ ! $lr =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] ||
   ! awk -v x="$lr" 'BEGIN { v = x + 0; exit !(v > 0 && v < 1e300) }'; then
  die "--lr must be a positive number below 1e300 (got '$lr')"
fi
# The one-process baseline takes the step the job takes per round: bsp applies
# the mean of the N gradients with lr (a batch of N*B at lr), asp and ssp
# apply each worker's gradient with lr (about N*lr per N*B samples).
# (The default lr 0.05/N was rounded to 6 digits: the baseline takes 0.05
# itself, not 0.0500001.)
if [[ $mode == bsp ]]; then
  baseline_lr=$lr
elif ((lr_default)); then
  baseline_lr=0.05
else
  baseline_lr=$(awk -v l="$lr" -v n="$workers" 'BEGIN { printf "%.6g", l * n }')
fi
[[ $min_accuracy =~ ^(0(\.[0-9]+)?|1(\.0+)?)$ ]] || die "--min-accuracy must be in [0, 1] (got '$min_accuracy')"

if [[ -t 1 ]]; then bold=$'\e[1m'; red=$'\e[31m'; green=$'\e[32m'; off=$'\e[0m'; else bold=""; red=""; green=""; off=""; fi
say() { echo "${bold}==>${off} $*"; }

# ---------------------------------------------------------------- clean-up
run_dir=$(mktemp -d "${TMPDIR:-/tmp}/ember-demo.XXXXXX")
server_pids=()
launcher_pid=""
ok=0
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n $launcher_pid ]] && kill -0 "$launcher_pid" 2>/dev/null; then
    kill -TERM "$launcher_pid" 2>/dev/null || true   # it stops its workers
    wait "$launcher_pid" 2>/dev/null || true
  fi
  for p in "${server_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${server_pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  if ((ok && !keep_logs)); then
    rm -rf "$run_dir"
  else
    echo "demo: logs are in $run_dir" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
interrupted() {  # the SIGINT/SIGTERM trap: cleanup (the EXIT trap) stops the servers and workers
  echo >&2
  echo "demo: interrupted ($1): stopping the servers and workers" >&2
  exit 130
}
trap 'interrupted SIGINT' INT
trap 'interrupted SIGTERM' TERM

fail() {
  echo "${red}demo: FAILED: $*${off}" >&2
  exit 1
}
show_log() {  # show_log FILE: the end of a log, indented
  [[ -f $1 ]] || return 0
  echo "---- last lines of $1" >&2
  tail -n 15 "$1" | sed 's/^/    /' >&2
}

# ---------------------------------------------------------------- deps + build
t_start=$SECONDS
if [[ ${EMBER_SKIP_DEPS:-0} != 1 ]]; then
  say "dependencies (scripts/install-deps.sh)"
  scripts/install-deps.sh || fail "scripts/install-deps.sh failed"
fi
server_bin=$root/build/release/server/ember-server
worker_bin=$root/build/release/examples/fashion_mnist/fmnist-worker
baseline_bin=$root/build/release/examples/fashion_mnist/fmnist-baseline
# A clean build of the three targets took 3 min 48 s on 2 idle cores
# (2026-12-01); a rebuild after a change takes seconds to a minute.
first_build=""
[[ -x $server_bin ]] || first_build=" (first time: about 4 minutes on 2 idle cores)"
say "building the release preset: ember-server fmnist-worker fmnist-baseline$first_build"
cmake --preset release >"$run_dir/configure.log" 2>&1 || { show_log "$run_dir/configure.log"; fail "cmake --preset release failed"; }
cmake --build build/release -j "$(nproc)" --target ember-server fmnist-worker fmnist-baseline \
  >"$run_dir/build.log" 2>&1 || {
    echo "---- $run_dir/build.log: its first error lines, else its last lines" >&2
    { grep -E -m 20 '(error|FAILED)' "$run_dir/build.log" || tail -n 15 "$run_dir/build.log"; } | sed 's/^/    /' >&2
    fail "the build failed"
  }
t_built=$SECONDS

# ---------------------------------------------------------------- run config
# M free TCP ports on 127.0.0.1, held together so they differ (with shm they
# only name the servers' sockets).
read -r -a ports <<<"$(python3 - "$servers" <<'EOF'
import socket, sys
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
EOF
)"
server_list=$(printf '127.0.0.1:%s,' "${ports[@]}"); server_list=${server_list%,}
config=$run_dir/ember.toml
# The server validates the overrides and prints the effective config (every
# key, defaults included): that is the run config every process loads.
"$server_bin" --config config/ember.toml --print-config \
  --set "cluster.servers=$server_list" \
  --set "cluster.num_workers=$workers" \
  --set "communication.transport=$transport" \
  --set "communication.prealloc_pages=32" \
  --set "server.consistency=$mode" \
  --set "server.on_worker_loss=fail" \
  --set "optimizer.type=momentum" \
  --set "optimizer.learning_rate=$lr" \
  --set "optimizer.momentum=0.9" \
  >"$config" 2>"$run_dir/config.err" || { show_log "$run_dir/config.err"; fail "could not write the run config"; }

say "job: $workers worker(s) x batch $batch, $servers server(s) on ${server_list//,/ }, $transport, $mode, $epochs epoch(s), momentum SGD lr $lr m 0.9 (config $config)"

# ---------------------------------------------------------------- servers
t_train=$SECONDS
# The servers get the cores no worker is pinned to (launch_workers.sh pins
# worker r to core r % cores), when there are any, so that their threads do
# not preempt a worker's training thread; else they run unpinned.
server_pin=()
ncpu_all=$(nproc --all)
spare=""
for ((c = 0; c < ncpu_all; c++)); do
  ((c < workers)) && continue
  taskset -c "$c" true 2>/dev/null && spare+="${spare:+,}$c"
done
[[ -n $spare ]] && server_pin=(taskset -c "$spare")
# Over tcp, a spare core also takes the workers' I/O threads: each training
# thread keeps its own core (--compute-cpu) and the I/O thread, on the first
# spare core, makes every socket write (inline_write = 0), so the system
# calls' copies leave the training core (bench/train/run.py measures it).
launch_cores=(); worker_pin=()
if [[ -n $spare && $transport == tcp ]]; then
  comm_core=${spare%%,*}
  lists=""
  for ((r = 0; r < workers; r++)); do lists+="${lists:+:}$r,$comm_core"; done
  launch_cores=(--cores "$lists")
  worker_pin=(--compute-cpu '{rank}' --set "communication.cpu_affinity=[$comm_core]"
              --set communication.inline_write=0)
fi
for ((i = 0; i < servers; i++)); do
  "${server_pin[@]}" "$server_bin" --config "$config" --set "server.server_index=$i" >"$run_dir/server-$i.log" 2>&1 &
  server_pids+=($!)
done
for ((i = 0; i < servers; i++)); do
  deadline=$((SECONDS + 30))
  until grep -q '^ember-server ready' "$run_dir/server-$i.log" 2>/dev/null; do
    if ! kill -0 "${server_pids[i]}" 2>/dev/null; then
      show_log "$run_dir/server-$i.log"; fail "ember-server $i exited during start-up"
    fi
    ((SECONDS < deadline)) || { show_log "$run_dir/server-$i.log"; fail "ember-server $i not ready within 30 s"; }
    sleep 0.1
  done
  echo "    $(grep -m1 '^ember-server ready' "$run_dir/server-$i.log") (pid ${server_pids[i]})"
done

# ---------------------------------------------------------------- workers
say "training"
scripts/launch_workers.sh --workers "$workers" "${launch_cores[@]}" --log-dir "$run_dir" -- \
  "$worker_bin" --config "$config" --rank '{rank}' --epochs "$epochs" --batch-size "$batch" \
  --seed "$seed" --progress-every 5 "${worker_pin[@]}" 2>"$run_dir/launcher.log" &
launcher_pid=$!

bar() {  # bar DONE TOTAL WIDTH
  local filled=$(($1 * $3 / ($2 > 0 ? $2 : 1)))
  printf '%*s' "$filled" '' | tr ' ' '#'
  printf '%*s' "$(($3 - filled))" '' | tr ' ' '.'
}
field() {  # field LINE KEY: the value of KEY=value in LINE
  local re="(^| )$2=([^ ]*)"
  if [[ $1 =~ $re ]]; then echo "${BASH_REMATCH[2]}"; fi
}
percent() { awk -v x="$1" 'BEGIN { printf "%.1f%%", x * 100 }'; }
less_than() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }
# One bar per epoch, following the slowest worker; on a terminal it is
# redrawn in place ($cr returns to the start and clears the line).
shown_epoch=1
cr=""; [[ -t 1 ]] && cr=$'\r\e[K'
render() {
  local final=${1:-0} s_min=-1 total=0 loss="" line r log
  for ((r = 0; r < workers; r++)); do
    log=$run_dir/worker-$r.log
    line=$(grep -a "^progress epoch=$shown_epoch " "$log" 2>/dev/null | tail -n 1) || true
    local s=0
    if [[ -n $line ]]; then
      local st; st=$(field "$line" step); s=${st%/*}; total=${st#*/}
      [[ $r == 0 ]] && loss=$(field "$line" loss)
    fi
    ((s_min < 0 || s < s_min)) && s_min=$s
  done
  # An epoch is over when every worker printed its summary line.
  local done_all=1 accs=""
  for ((r = 0; r < workers; r++)); do
    line=$(grep -a "^epoch $shown_epoch/" "$run_dir/worker-$r.log" 2>/dev/null | tail -n 1) || true
    if [[ -z $line ]]; then done_all=0; break; fi
    accs+=" $(field "$line" test_accuracy)"
  done
  if ((done_all)); then
    line=$(grep -a "^epoch $shown_epoch/" "$run_dir/worker-0.log" | tail -n 1)
    # Accuracy of every worker; loss, speed and comm share of rank 0 (the
    # final table has every worker's).
    printf '%s  epoch %d/%d [%s] %s steps  test accuracy%s  rank 0: loss %s  %s samples/s  comm %s\n' \
      "$cr" "$shown_epoch" "$epochs" "$(bar 1 1 30)" "$(field "$line" steps)" "$accs" \
      "$(field "$line" train_loss)" "$(field "$line" samples_per_s)" "$(percent "$(field "$line" comm_share)")"
    shown_epoch=$((shown_epoch + 1))
    ((shown_epoch <= epochs)) && render "$final"
    return 0
  fi
  if [[ -t 1 ]] && ((total > 0)); then
    printf '\r\e[K  epoch %d/%d [%s] %d/%d steps  loss %s' "$shown_epoch" "$epochs" \
      "$(bar "$s_min" "$total" 30)" "$s_min" "$total" "${loss:--}"
  fi
}
while kill -0 "$launcher_pid" 2>/dev/null; do
  ((shown_epoch <= epochs)) && render
  sleep 0.25
done
set +e
wait "$launcher_pid"
launcher_rc=$?
set -e
launcher_pid=""
((shown_epoch <= epochs)) && render 1
[[ -t 1 ]] && ((shown_epoch <= epochs)) && echo
if ((launcher_rc != 0)); then
  cat "$run_dir/launcher.log" >&2
  for ((r = 0; r < workers; r++)); do show_log "$run_dir/worker-$r.log"; done
  for ((i = 0; i < servers; i++)); do show_log "$run_dir/server-$i.log"; done
  # The first worker error, in the last line too (e.g. "training diverged:
  # ... lower the learning rate"), so the reason is not only in the logs.
  reason=""
  for ((r = 0; r < workers; r++)); do
    reason=$(grep -a -m 1 -E '^fmnist-worker.*: (error|fatal): ' "$run_dir/worker-$r.log" 2>/dev/null) && break
  done
  fail "a worker failed (exit code $launcher_rc)${reason:+: $reason}"
fi

# ---------------------------------------------------------------- stop servers
say "stopping the servers (SIGTERM)"
for ((i = 0; i < servers; i++)); do kill -TERM "${server_pids[i]}"; done
for ((i = 0; i < servers; i++)); do
  set +e
  wait "${server_pids[i]}"
  rc=$?
  set -e
  if ((rc != 0)); then show_log "$run_dir/server-$i.log"; fail "ember-server $i exited with $rc after SIGTERM (expected 0)"; fi
done
server_pids=()

t_trained=$SECONDS
# ---------------------------------------------------------------- baseline
say "baseline: the same model in one process without Ember (batch $((workers * batch)), seed $seed)"
"$baseline_bin" --batch-size $((workers * batch)) --epochs "$epochs" --seed "$seed" \
  --optimizer sgd --lr "$baseline_lr" --momentum 0.9 >"$run_dir/baseline.log" 2>&1 \
  || { show_log "$run_dir/baseline.log"; fail "fmnist-baseline failed"; }
baseline=$(grep -a '^RESULT' "$run_dir/baseline.log" | tail -n 1)

# ---------------------------------------------------------------- table
echo
echo "${bold}Fashion-MNIST MLP 784-256-128-10, $epochs epoch(s), momentum SGD m 0.9, seed $seed${off}"
echo "Ember: $workers worker(s) x batch $batch, $servers server(s), $transport, $mode, lr $lr; one process: batch $((workers * batch)), lr $baseline_lr"
printf '%-26s %6s %9s %11s %11s %9s\n' "run" "epochs" "test acc" "samples/s" "comm share" "train s"
total_rate=0
slowest=0
below=()
for ((r = 0; r < workers; r++)); do
  res=$(grep -a '^RESULT' "$run_dir/worker-$r.log" | tail -n 1) || fail "worker $r printed no RESULT line"
  acc=$(field "$res" test_accuracy); rate=$(field "$res" samples_per_s)
  share=$(field "$res" comm_share); secs=$(field "$res" train_s)
  total_rate=$((total_rate + rate))
  slowest=$(awk -v a="$slowest" -v b="$secs" 'BEGIN { print (b > a ? b : a) }')
  printf '%-26s %6s %9s %11s %11s %9s\n' "ember worker $r" "$epochs" "$acc" "$rate" \
    "$(percent "$share")" "$secs"
  if less_than "$acc" "$min_accuracy"; then below+=("worker $r: $acc"); fi
done
printf '%-26s %6s %9s %11s %11s %9s\n' "ember, all workers" "$epochs" "" "$total_rate" "" ""
printf '%-26s %6s %9s %11s %11s %9s\n' "baseline, 1 process" "$epochs" "$(field "$baseline" test_accuracy)" \
  "$(field "$baseline" samples_per_s)" "-" "$(field "$baseline" train_s)"
echo "(samples/s: training samples per second of training time, evaluation excluded; comm share:"
echo " time a worker's training thread was blocked on Ember over its training time)"
awk -v b="$(field "$baseline" train_s)" -v e="$slowest" -v n="$workers" 'BEGIN {
  if (e > 0) printf "training time: %.2f s with Ember (slowest worker) vs %.2f s in one process: %.2fx with %d worker(s)\n", e, b, b / e, n }'
deps_label="dependencies + build"
[[ ${EMBER_SKIP_DEPS:-0} == 1 ]] && deps_label="build (dependencies skipped: EMBER_SKIP_DEPS=1)"
echo "wall time: $((t_built - t_start)) s $deps_label, $((t_trained - t_train)) s servers + workers, $((SECONDS - t_trained)) s baseline"
if ((${#below[@]} > 0)); then
  fail "test accuracy below $min_accuracy: ${below[*]}"
fi
[[ $min_accuracy != 0 ]] && echo "${green}demo: OK${off} (every worker reached test accuracy >= $min_accuracy)" \
  || echo "${green}demo: OK${off}"
ok=1
