#!/usr/bin/env bash
# tierzero-train with 2 ranks launched by mpirun (Note [MPI rendezvous]):
#   1. the reference: 2 ranks on one host, meeting in a rendezvous directory;
#   2. mpirun -np 2 on one host: the ranks meet through MPI (the log says
#      so), and the losses and gradient norms equal the reference's bit for bit;
#   3. two hosts (lib.sh: network namespaces, no shared /tmp): mpirun on host
#      a starts rank 1 on host b (through netns_rsh.sh, as through ssh); Gloo
#      binds to GLOO_SOCKET_IFNAME=tz0; the losses equal the reference's;
#   4. a rank that never arrives (rank 1 on host b is `sleep`): rank 0 fails
#      within its timeout, naming its host, and mpirun ends the job.
#   5. the file rendezvous across the two hosts, in a directory both see (a
#      shared file system) with MASTER_ADDR, and the losses equal the reference's.
# Usage: train_mpirun.sh TRAIN WORK_DIR. Exits 77 (skipped) with the reason
# where the machine refuses network namespaces, after parts 1 and 2 passed.
set -euo pipefail
TRAIN=$1 WORK=$2 HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
fresh_work "$WORK"
keep_visible "$WORK" "$(dirname "$TRAIN")"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ARGS=(--backend host --preset tiny --steps 4 --eval-every 0 --log-every 1 --threads 1)
PORT=$((20000 + $$ % 20000))

# Each rank: its own swap folder and outputs, named by the launcher's rank variable.
RANK_RUN='r=${OMPI_COMM_WORLD_RANK:-$RANK}; exec "$0" "$@" --nvme-path "$TZ_OUT/nvme$r" --out "$TZ_OUT/out$r"'

# two_ranks TAG HOST0 HOST1 ADDR: ranks 0 and 1 with torchrun's variables on
# the hosts named ("here" for this one), meeting in the directory WORK/TAG-rdzv.
two_ranks() {
  local tag=$1 addr=$4 pids=() r run
  for r in 0 1; do
    run=()
    local host=$2
    [ "$r" -eq 1 ] && host=$3
    [ "$host" = here ] || run=(on_host "$host")
    "${run[@]}" env RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR="$addr" MASTER_PORT=$PORT \
      TIERZERO_RENDEZVOUS_DIR="$WORK/$tag-rdzv" TZ_OUT="$WORK/$tag" \
      sh -c "$RANK_RUN" "$TRAIN" "${ARGS[@]}" --collective-timeout 120 >"$WORK/$tag$r.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}" || { cat "$WORK/${tag}0.log"; fail "$tag: rank 0"; }
  wait "${pids[1]}" || { cat "$WORK/${tag}1.log"; fail "$tag: rank 1"; }
}

echo "--- 1. reference: 2 ranks on one host, file rendezvous"
two_ranks ref here here 127.0.0.1

echo "--- 2. mpirun -np 2 on one host"
TZ_OUT="$WORK/mpi1" timeout 300 mpirun -np 2 --oversubscribe -x TZ_OUT sh -c "$RANK_RUN" "$TRAIN" "${ARGS[@]}" \
  --collective-timeout 120 >"$WORK/mpi1.log" 2>&1 || { cat "$WORK/mpi1.log"; fail "mpirun on one host"; }
grep -q "rank 1 of 2 on .* (launched by mpirun (Open MPI)) meets the others through MPI (Open MPI" "$WORK/mpi1.log" ||
  { cat "$WORK/mpi1.log"; fail "the log does not say the ranks met through MPI"; }
same_losses "$WORK/ref/out0" "$WORK/mpi1/out0" "mpirun, one host"

echo "--- 3. mpirun across two hosts"
hosts_up
export TZ_NS_A=$NS_A TZ_NS_B=$NS_B TZ_ADDR_A=$HOST_A_ADDR TZ_ADDR_B=$HOST_B_ADDR
MPIRUN2=(mpirun --mca plm_rsh_agent "$HERE/netns_rsh.sh" --mca btl_tcp_if_include tz0 --mca oob_tcp_if_include tz0
         -H "$HOST_A_ADDR,$HOST_B_ADDR" -np 2)
TZ_OUT="$WORK/mpi2" on_host a timeout 300 "${MPIRUN2[@]}" -x TZ_OUT -x GLOO_SOCKET_IFNAME=tz0 \
  sh -c "$RANK_RUN" "$TRAIN" "${ARGS[@]}" --collective-timeout 120 >"$WORK/mpi2.log" 2>&1 ||
  { cat "$WORK/mpi2.log"; fail "mpirun across two hosts"; }
grep -q "rank 1 of 2 on hostb (launched by mpirun (Open MPI)) meets the others through MPI" "$WORK/mpi2.log" ||
  { cat "$WORK/mpi2.log"; fail "rank 1 did not run on host b through MPI"; }
grep -q "gloo over tcp (tz0)" "$WORK/mpi2.log" || { cat "$WORK/mpi2.log"; fail "Gloo did not bind to tz0"; }
same_losses "$WORK/ref/out0" "$WORK/mpi2/out0" "mpirun, two hosts"

echo "--- 4. mpirun across two hosts, rank 1 never arrives"
TZ_OUT="$WORK/mpi-missing" expect_failure "$WORK/mpi-missing.log" 60 \
  "MPI_Init did not finish within 5000 ms on rank 0 of 2 \(hosta\)" \
  on_host a timeout 120 mpirun --mca plm_rsh_agent "$HERE/netns_rsh.sh" \
  --mca btl_tcp_if_include tz0 --mca oob_tcp_if_include tz0 -x TZ_OUT -x GLOO_SOCKET_IFNAME=tz0 \
  -H "$HOST_A_ADDR" -np 1 sh -c "$RANK_RUN" "$TRAIN" "${ARGS[@]}" --collective-timeout 5 : \
  -H "$HOST_B_ADDR" -np 1 sleep 100
echo "a rank that never arrived: failed after $TOOK s, named"

echo "--- 5. file rendezvous across two hosts in a shared directory"
two_ranks shared a b "$HOST_A_ADDR"
grep -q "gloo over tcp (tz0 10.77.0.2)" "$WORK/shared1.log" || { cat "$WORK/shared1.log"; fail "rank 1 not on tz0"; }
same_losses "$WORK/ref/out0" "$WORK/shared/out0" "file rendezvous, two hosts"
echo "train mpirun ok"
