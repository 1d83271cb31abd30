#!/usr/bin/env bash
# tierzero.torch under torchrun across two hosts (lib.sh: network namespaces
# joined by a veth pair, no shared /tmp), meeting through torchrun's TCPStore:
#   1. the reference: torchrun --nproc-per-node 2 on one host;
#   2. torchrun --nnodes 2 --node-rank 0|1, one rank per host, the store at
#      host a's MASTER_ADDR:MASTER_PORT: the ranks say they met through it,
#      and the trained master weights equal the reference's bit for bit;
#   3. rank 1 never arrives (it sleeps): rank 0 fails within its timeout
#      naming the store's address and port and the missing rank;
#   4. host a's firewall drops the store's port: rank 1 on host b fails
#      within the timeout naming that address and port.
# Usage: torchrun_two_hosts.sh PYTHON WORK_DIR (PYTHON has tierzero and torch;
# WORK_DIR not under /tmp, which each host has its own of).
# Exits 77 (skipped) with the reason where the machine refuses network namespaces.
set -euo pipefail
PY=$1 WORK=$2 HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
fresh_work "$WORK"
keep_visible "$WORK"
WORKER="$HERE/torch_worker.py"
PORT=$((30000 + $$ % 20000))
export GLOO_SOCKET_IFNAME=tz0 TIERZERO_LOG=info

echo "--- 1. reference: torchrun --nproc-per-node 2 on one host"
env -u GLOO_SOCKET_IFNAME timeout 300 "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 \
  --master-addr 127.0.0.1 --master-port "$PORT" "$WORKER" "$WORK/ref.pt" 60 >"$WORK/ref.log" 2>&1 ||
  { cat "$WORK/ref.log"; fail "torchrun on one host"; }
grep -q "meets the others through torch TCPStore at 127.0.0.1:$PORT" "$WORK/ref.log" ||
  { cat "$WORK/ref.log"; fail "the ranks did not meet through torchrun's store"; }

hosts_up
# torchrun --nnodes 2 on the two hosts, node 0 on host a, in the background
# (pids in NODE_PIDS); extra environment first.
start_two_hosts() {
  local tag=$1 timeout_s=$2
  shift 2
  NODE_PIDS=()
  for node in 0 1; do
    local host=a
    [ "$node" -eq 1 ] && host=b
    on_host $host env "$@" timeout 300 "$PY" -m torch.distributed.run --nnodes 2 --node-rank $node \
      --nproc-per-node 1 --master-addr "$HOST_A_ADDR" --master-port "$PORT" "$WORKER" "$WORK/$tag.pt" "$timeout_s" \
      >"$WORK/$tag-node$node.log" 2>&1 &
    NODE_PIDS+=($!)
  done
}

echo "--- 2. torchrun --nnodes 2, one rank on each host"
start_two_hosts two 60 TZ_TEST=1
wait "${NODE_PIDS[0]}" || { cat "$WORK"/two-node*.log; fail "torchrun across two hosts, node 0"; }
wait "${NODE_PIDS[1]}" || { cat "$WORK"/two-node*.log; fail "torchrun across two hosts, node 1"; }
grep -q "rank 1 of 2 on hostb (launched by torchrun) meets the others through torch TCPStore at $HOST_A_ADDR:$PORT" \
  "$WORK/two-node1.log" || { cat "$WORK"/two-node*.log; fail "rank 1 did not meet through host a's store"; }
grep -q "gloo over tcp (tz0)" "$WORK/two-node1.log" || { cat "$WORK"/two-node*.log; fail "Gloo not on tz0"; }
"$PY" - "$WORK/ref.pt" "$WORK/two.pt" <<'PYEOF' || fail "the two-host weights differ from the one-host run's"
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert a.keys() == b.keys(), (a.keys(), b.keys())
bad = [n for n in a if not torch.equal(a[n], b[n])]
assert not bad, f"differ: {bad}"
print(f"two hosts: {len(a)} tensors, {sum(t.numel() for t in a.values())} weights equal to the one-host run's")
PYEOF

echo "--- 3. rank 1 never arrives"
start=$(date +%s)
start_two_hosts missing 5 TZ_TEST_NEVER_ARRIVE=1
if wait "${NODE_PIDS[0]}"; then fail "rank 0 trained without rank 1"; fi
took=$(($(date +%s) - start))
# Rank 1 sleeps on; torchrun on host b would wait for it: end what this test started there.
for pid in $(ip netns pids "$NS_B"); do kill -KILL "$pid" 2>/dev/null || true; done
wait "${NODE_PIDS[1]}" || true
cat "$WORK/missing-node0.log"
grep -q "TimeoutError: rendezvous through torch TCPStore at $HOST_A_ADDR:$PORT (communicator 1) timed out after 5000 ms: rank 0 of 2 on hosta is still waiting for rank(s) 1 to arrive" \
  "$WORK/missing-node0.log" || fail "rank 0's error does not name the store's address and port and rank 1"
[ "$took" -le 90 ] || fail "node 0 took $took s with a 5 s timeout"
echo "a rank that never arrived: rank 0 failed, named ($took s in all, torchrun's start and teardown included)"

echo "--- 4. host a's firewall drops the store's port"
firewall_drop a "$PORT"
expect_failure "$WORK/dropped.log" 60 \
  "TimeoutError: tierzero: rank 1 of 2 could not reach torchrun's store at MASTER_ADDR=$HOST_A_ADDR MASTER_PORT=$PORT within 5 s" \
  on_host b env TORCHELASTIC_RUN_ID=dropped RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
  MASTER_ADDR="$HOST_A_ADDR" MASTER_PORT="$PORT" TORCHELASTIC_USE_AGENT_STORE=True timeout 120 "$PY" "$WORKER" "$WORK/dropped.pt" 5
echo "a dropped port: failed after $TOOK s, named"
echo "torchrun two hosts ok"
