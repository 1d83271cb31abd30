#!/bin/sh
# mpirun's remote shell between the test's hosts (lib.sh): Open MPI runs
# `netns_rsh.sh HOST WORDS...` where it would run `ssh HOST WORDS...`; the
# words are one shell command (ssh joins them with spaces), run here on HOST
# (its network namespace, its own /tmp and host name) as ssh would run it.
# Reads the namespaces from TZ_NS_A / TZ_NS_B and the addresses from
# TZ_ADDR_A / TZ_ADDR_B, which the test exports.
host=$1
shift
case "$host" in
  "$TZ_ADDR_A" | hosta) ns=$TZ_NS_A name=hosta ;;
  "$TZ_ADDR_B" | hostb) ns=$TZ_NS_B name=hostb ;;
  *) echo "netns_rsh.sh: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --mount --uts --propagation private \
  sh -c 'mount -t tmpfs tmpfs /tmp && hostname "$0" && exec sh -c "$1"' "$name" "$*"
