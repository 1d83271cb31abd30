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
# As lib.sh's on_host: a fresh /tmp, with the paths in TZ_KEEP (exported by
# lib.sh) under /tmp bound back from the /tmp underneath.
exec ip netns exec "$ns" unshare --mount --uts --propagation private \
  sh -c 'cd /tmp && mount -t tmpfs tmpfs /tmp || exit 1
    for p in $TZ_KEEP; do
      case "$p" in /tmp/?*) mkdir -p "$p" && mount --no-canonicalize --bind "./${p#/tmp/}" "$p" || exit 1 ;; esac
    done
    cd / && hostname "$0" && exec sh -c "$1"' "$name" "$*"
