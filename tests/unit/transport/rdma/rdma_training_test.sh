#!/usr/bin/env bash
# End to end over rdma (ctest label rdma; runs in the Soft-RoCE guest):
# ember-server and 2 fmnist-worker processes train the Fashion-MNIST MLP
# (784-32-10, batch 32 per worker, bsp, momentum SGD) for 2 x 100 steps with
# [communication] transport = "rdma" on the RDMA device's address. Passes
# when both workers finish, the loss falls, test accuracy rises above 0.7,
# the server says it used rdma, and it exits 0 on SIGTERM.
#
#   rdma_training_test.sh <ember-server> <fmnist-worker>
# Exit 77 (ctest: skipped) without an RDMA device address (EMBER_RDMA_IP,
# exported by the guest's init) or without the dataset.
set -uo pipefail
server_bin=$1
worker_bin=$2
ip=${EMBER_RDMA_IP:-}
if [[ -z $ip ]]; then
  echo "SKIP: no RDMA device address (EMBER_RDMA_IP is set inside the Soft-RoCE guest: scripts/rdma-vm/suite.sh)"
  exit 77
fi
if [[ ! -d /usr/share/datasets/fashion-mnist ]]; then
  echo "SKIP: the dataset is missing (apt-get install dataset-fashion-mnist)"
  exit 77
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/ember-rdma-train.XXXXXX")
server_pid=""
pids=()
cleanup() {
  for p in "${pids[@]}" $server_pid; do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.log; do echo "---- $f"; tail -n 30 "$f"; done
  exit 1
}
# Waits (deadline in seconds) until `file` has a line matching `regex`.
wait_for_line() {
  local file=$1 regex=$2 deadline=$(($(date +%s) + $3))
  while (($(date +%s) < deadline)); do
    grep -qE "$regex" "$file" 2>/dev/null && return 0
    if [[ -n $server_pid ]] && ! kill -0 "$server_pid" 2>/dev/null; then return 1; fi
    sleep 0.2
  done
  return 1
}

cat > "$dir/job.toml" <<EOF
[communication]
transport = "rdma"
auth_token = "ember-rdma-training-test"
prealloc_pages = 16
heartbeat_interval = "250ms"
heartbeat_timeout = "10s"
[cluster]
servers = ["$ip:1"]
num_workers = 2
[server]
consistency = "bsp"
on_worker_loss = "fail"
[optimizer]
type = "momentum"
learning_rate = 0.05
momentum = 0.9
[worker]
request_timeout = "120s"
connect_retries = 0
EOF

"$server_bin" --config "$dir/job.toml" --listen "$ip:0" > "$dir/server.log" 2>&1 &
server_pid=$!
wait_for_line "$dir/server.log" '^ember-server ready' 60 || fail "ember-server did not become ready"
port=$(sed -n 's/^ember-server ready listen=[^ ]*:\([0-9]*\).*/\1/p' "$dir/server.log" | head -n1)
[[ -n $port ]] || fail "no listen address in the ready line"
grep -q "rdma" "$dir/server.log" || fail "the server log does not mention rdma"

for rank in 0 1; do
  "$worker_bin" --config "$dir/job.toml" --rank "$rank" --set "cluster.servers=$ip:$port" \
    --hidden 32 --batch-size 32 --eval-batch-size 500 --max-eval-samples 2000 \
    --epochs 2 --max-steps-per-epoch 100 --progress-every 10 --initial-eval --log-level warn \
    > "$dir/worker-$rank.log" 2>&1 &
  pids+=($!)
done
for i in 0 1; do
  wait "${pids[$i]}" || fail "worker $i exited with status $?"
done
pids=()

num() {  # num LINE KEY
  sed -n "s/.*\(^\| \)$2=\([^ ]*\).*/\2/p" <<<"$1"
}
for rank in 0 1; do
  log=$dir/worker-$rank.log
  result=$(grep '^RESULT ' "$log" | tail -n1)
  [[ -n $result ]] || fail "worker $rank printed no RESULT line"
  epochs=$(grep -c '^epoch ' "$log")
  ((epochs == 2)) || fail "worker $rank: $epochs epoch lines, expected 2"
  l0=$(num "$(grep '^epoch ' "$log" | sed -n 1p)" train_loss)
  l1=$(num "$(grep '^epoch ' "$log" | sed -n 2p)" train_loss)
  acc0=$(num "$(grep '^initial ' "$log" | head -n1)" test_accuracy)
  acc=$(num "$result" test_accuracy)
  steps=$(num "$result" steps)
  echo "worker $rank: train_loss $l0 -> $l1, test_accuracy $acc0 -> $acc, steps $steps"
  [[ $steps == 200 ]] || fail "worker $rank ran $steps steps, expected 200"
  awk -v a="$l0" -v b="$l1" 'BEGIN{exit !(b < a)}' || fail "worker $rank: loss did not fall ($l0 -> $l1)"
  awk -v a="$acc" 'BEGIN{exit !(a > 0.70)}' || fail "worker $rank: test accuracy $acc <= 0.70"
done

kill -TERM "$server_pid"
wait "$server_pid"
rc=$?
server_pid=""
((rc == 0)) || fail "ember-server exited with status $rc after SIGTERM"
echo "PASS: 2 workers, 200 bsp steps over rdma ($ip:$port)"
rm -rf "$dir"
