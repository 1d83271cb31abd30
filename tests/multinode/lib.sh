# Two "hosts" on one machine for the multi-node tests: two network namespaces
# joined by a veth pair, each with its own address and, for every process
# started on it, its own mount namespace with a private /tmp, so the ranks on
# the two hosts share no network stack and no /tmp (they still see the rest
# of the file system: the programs and the tests' result folders).
#
#   . tests/multinode/lib.sh
#   hosts_up                     # or exit 77 (skipped) with the reason
#   on_host a CMD...             # runs CMD on host a (10.77.0.1), b is 10.77.0.2
#   ... every namespace and veth goes at exit, whatever happened (trap)
#
# Both ends of the veth are called tz0 inside their namespaces, so
# GLOO_SOCKET_IFNAME=tz0 names the link on either host.

HOST_A_ADDR=10.77.0.1
HOST_B_ADDR=10.77.0.2
NS_A="tz-$$-a"
NS_B="tz-$$-b"

# fresh_work DIR: an empty results folder for the test.
fresh_work() {
  rm -rf "$1"
  mkdir -p "$1"
}

skip() {
  echo "SKIPPED: $*"
  exit 77
}

ns_of() {
  case "$1" in
    a | "$HOST_A_ADDR") echo "$NS_A" ;;
    b | "$HOST_B_ADDR") echo "$NS_B" ;;
    *) echo "lib.sh: no host $1" >&2; return 1 ;;
  esac
}

hosts_down() {
  local ns pid
  for ns in "$NS_A" "$NS_B"; do
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      # Only what this test started lives there.
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  ip link del "tzva$$" 2>/dev/null || true  # a veth left in the root namespace by a setup cut short
}

hosts_up() {
  [ "$(id -u)" -eq 0 ] || skip "network namespaces need root (running as uid $(id -u))"
  command -v ip >/dev/null || skip "no ip (iproute2) to make network namespaces"
  command -v unshare >/dev/null || skip "no unshare (util-linux) to give each host its own /tmp"
  trap hosts_down EXIT
  trap 'exit 130' INT TERM
  ip netns add "$NS_A" 2>/dev/null || skip "this machine refuses network namespaces (ip netns add failed)"
  ip netns add "$NS_B" || skip "this machine refuses a second network namespace"
  ip link add "tzva$$" type veth peer name "tzvb$$" || skip "this machine refuses veth pairs"
  ip link set "tzva$$" netns "$NS_A"
  ip link set "tzvb$$" netns "$NS_B"
  ip -n "$NS_A" link set "tzva$$" name tz0
  ip -n "$NS_B" link set "tzvb$$" name tz0
  ip -n "$NS_A" addr add "$HOST_A_ADDR/24" dev tz0
  ip -n "$NS_B" addr add "$HOST_B_ADDR/24" dev tz0
  for ns in "$NS_A" "$NS_B"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set tz0 up
  done
  on_host a true || skip "cannot start a process with its own mount namespace in $NS_A (unshare --mount refused)"
}

# keep_visible PATH...: paths the hosts must still see (the programs, the
# tests' result folders, this tree) although they lie under /tmp, as a clone
# CI checks out there does. The tree this file is in is always kept.
# Exported: netns_rsh.sh (mpirun's remote shell) keeps the same ones.
export TZ_KEEP
TZ_KEEP="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
keep_visible() {
  local p
  for p in "$@"; do TZ_KEEP="$TZ_KEEP $(cd "$p" && pwd)"; done
}

# on_host a|b CMD...: CMD in that host's network namespace, with a fresh
# tmpfs on /tmp and its own host name (hosta, hostb). The kept paths under
# /tmp are bound back over the tmpfs from the /tmp underneath (reached
# through the working directory, taken before the tmpfs hides it; mount must
# not canonicalize the relative source, or it names the new, empty /tmp).
on_host() {
  local ns name
  ns=$(ns_of "$1") || return 1
  case "$ns" in "$NS_A") name=hosta ;; *) name=hostb ;; esac
  shift
  ip netns exec "$ns" env TZ_KEEP="$TZ_KEEP" unshare --mount --uts --propagation private \
    sh -c 'here=$1; shift; cd /tmp && mount -t tmpfs tmpfs /tmp || exit 1
      for p in $TZ_KEEP; do
        case "$p" in /tmp/?*) mkdir -p "$p" && mount --no-canonicalize --bind "./${p#/tmp/}" "$p" || exit 1 ;; esac
      done
      cd "$here" && hostname "$0" && exec "$@"' "$name" "$PWD" "$@"
}

# firewall_drop a|b PORT: the host silently drops what a firewall rule
# `-p tcp --dport PORT -j DROP` would: with iptables or nft, that rule; on
# kernels without netfilter (and without tc's filter actions, as this test's
# CI machine), every packet the host sends on tz0 is dropped instead (tc
# pfifo with room for none), which a peer sees the same way for PORT: no
# answer at all, not a refusal. Use it where PORT is the host's only traffic.
firewall_drop() {
  local ns
  ns=$(ns_of "$1") || return 1
  if command -v iptables >/dev/null && ip netns exec "$ns" iptables -A INPUT -p tcp --dport "$2" -j DROP 2>/dev/null; then
    return 0
  fi
  if command -v nft >/dev/null && ip netns exec "$ns" nft add table ip tz 2>/dev/null &&
    ip netns exec "$ns" nft add chain ip tz in '{ type filter hook input priority 0; }' &&
    ip netns exec "$ns" nft add rule ip tz in tcp dport "$2" drop; then
    return 0
  fi
  ip netns exec "$ns" tc qdisc add dev tz0 root pfifo limit 0
}

# expect_failure LOG MAX_S PATTERN CMD...: CMD must fail, within MAX_S
# seconds, writing PATTERN (grep -E) to LOG; prints LOG. CMD bounds itself
# with `timeout 120` (exit 124: still waiting).
expect_failure() {
  local log=$1 max_s=$2 pattern=$3 start rc=0
  shift 3
  start=$(date +%s)
  "$@" >"$log" 2>&1 || rc=$?
  TOOK=$(($(date +%s) - start))
  cat "$log"
  [ "$rc" -ne 0 ] || fail "$* succeeded"
  [ "$rc" -ne 124 ] || fail "$* was still waiting after 120 s"
  grep -qE "$pattern" "$log" || fail "the error does not say: $pattern"
  [ "$TOOK" -le "$max_s" ] || fail "took $TOOK s (at most $max_s expected)"
}

# fail MESSAGE: the test failed.
fail() {
  echo "FAILED: $*" >&2
  exit 1
}

# Every step's loss and gradient norm from tierzero-train's summary.json, in
# order, as JSON writes doubles (the shortest text that reads back as the same
# double: equal text is equal bits).
losses() {
  grep -oE '"(loss|grad_norm)": [^,}]*' "$1/summary.json"
}

# same_losses REF_OUT OTHER_OUT LABEL: the same losses and gradient norms, bit
# for bit, or fail.
same_losses() {
  [ -s "$1/summary.json" ] || fail "$3: no reference summary in $1"
  [ -s "$2/summary.json" ] || fail "$3: no summary in $2"
  [ "$(losses "$1" | wc -l)" -gt 0 ] || fail "$3: no losses in $1/summary.json"
  if ! diff <(losses "$1") <(losses "$2") >/dev/null; then
    diff <(losses "$1") <(losses "$2") >&2 || true
    fail "$3: the losses differ from the one-host run"
  fi
  echo "$3: $(losses "$2" | grep -c loss) steps, losses and gradient norms bit for bit the one-host run's" \
    "(last loss $(losses "$2" | grep loss | tail -1 | cut -d' ' -f2))"
}
