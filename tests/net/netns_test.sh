#!/usr/bin/env bash
# Multi-host tests of the storage service: a server and a client in two network namespaces joined by
# a veth pair that this test creates (addresses 10.250.<n>.1/.2, only inside those namespaces) and
# removes afterwards. UCX is limited to TCP so traffic really crosses the link.
#   (a) transfer with checksums; (b) server SIGKILLed mid-transfer: the client fails within its
#   deadline, 20 trials, no hang; (c) server restarted: the next read succeeds; (d) link down: the
#   client gets a timeout/network error within its deadline.
# Exit 77 (skipped) without root or iproute2.
set -u
FERRY=${1:?usage: netns_test.sh path/to/ferry}
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIPPED: needs root and iproute2 (ip, tc) to create network namespaces"; exit 77
fi
n=$(( ($$ % 200) + 20 ))
S=ferry-srv-$$ C=ferry-cli-$$ SRV=10.250.$n.1 PORT=7070
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  ip netns del "$S" 2>/dev/null; ip netns del "$C" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$S" && ip netns add "$C" || { echo "SKIPPED: cannot create network namespaces here"; exit 77; }
ip link add "vs$n" type veth peer name "vc$n"
ip link set "vs$n" netns "$S"; ip link set "vc$n" netns "$C"
ip -n "$S" addr add "$SRV/24" dev "vs$n"; ip -n "$C" addr add "10.250.$n.2/24" dev "vc$n"
ip -n "$S" link set lo up; ip -n "$C" link set lo up
ip -n "$S" link set "vs$n" up; ip -n "$C" link set "vc$n" up
# ~200 Mbit/s on the server side, so a 64 MiB read takes ~2.7 s and a kill lands mid-transfer even on a
# loaded machine.
tc -n "$S" qdisc add dev "vs$n" root tbf rate 200mbit burst 256kb latency 100ms
export UCX_TLS=tcp FERRY_DEADLINE=8s
mkdir -p "$work/export"
"$FERRY" cp host "file:$work/export/data.bin" --size 64MiB >/dev/null || { echo "FAIL: cannot make the dataset"; exit 1; }
fails=0
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
serve() {
  ip netns exec "$S" env UCX_NET_DEVICES="vs$n" "$FERRY" serve --root "$work/export" --listen "$SRV:$PORT" > "$work/serve.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 50); do
    ip netns exec "$C" env UCX_NET_DEVICES="vc$n" "$FERRY" stat "ferry://$SRV:$PORT/data.bin" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "FAIL: server did not come up"; cat "$work/serve.log"; return 1
}
client_cp() { ip netns exec "$C" env UCX_NET_DEVICES="vc$n" timeout 60 "$FERRY" cp "ferry://$SRV:$PORT/data.bin" host; }
last_error() { echo "$1" | grep -E "ferry: error|checksum" | tail -1 | cut -c1-170; }

echo "== (a) transfer with checksums across the veth link"
serve || exit 1
out=$(client_cp 2>&1); echo "$out"
echo "$out" | grep -q "checksum verified" || { echo "FAIL (a)"; fails=$((fails+1)); }

echo "== (b) server SIGKILLed mid-transfer, 20 trials"
hangs=0 errors=0 clean=0
for t in $(seq 20); do
  kill -9 "${pids[-1]}" 2>/dev/null; wait "${pids[-1]}" 2>/dev/null
  serve || exit 1
  srv=${pids[-1]}
  start=$(now_ms)
  # The client needs ~0.3 s to start and connect; the 64 MiB transfer then takes ~2.7 s at this rate.
  delay_ms=$(( 1000 + (t % 4) * 200 ))
  ( sleep "$((delay_ms / 1000)).$(printf %03d $((delay_ms % 1000)))"; kill -9 "$srv" ) &
  out=$(client_cp 2>&1); rc=$?
  took_ms=$(( $(now_ms) - start ))
  if [ "$rc" = 124 ]; then hangs=$((hangs+1)); fi
  # Every trial must fail cleanly: an error naming the peer, within the deadline, no hang. Those whose
  # error says the connection was lost during the request are the mid-transfer ones.
  if [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$took_ms" -lt 10000 ] && echo "$out" | grep -q "ferry: error: .*$SRV:$PORT"; then
    clean=$((clean+1))
  fi
  if echo "$out" | grep -q "$SRV:$PORT.*connection lost during the request"; then errors=$((errors+1)); fi
  printf "trial %2d: exit %s in %d ms: %s\n" "$t" "$rc" "$took_ms" "$(last_error "$out")"
  wait "$srv" 2>/dev/null
done
echo "(b): $clean of 20 trials ended in an error naming the peer within the deadline ($errors mid-transfer), $hangs hangs"
[ "$hangs" = 0 ] && [ "$clean" = 20 ] && [ "$errors" -ge 15 ] || { echo "FAIL (b)"; fails=$((fails+1)); }

echo "== (c) server restarted: the next read succeeds"
serve || exit 1
out=$(client_cp 2>&1); echo "$out"
echo "$out" | grep -q "checksum verified" || { echo "FAIL (c)"; fails=$((fails+1)); }

echo "== (d) link set down mid-transfer: timeout or network error within the deadline"
start=$(now_ms)
( sleep 0.3; ip -n "$C" link set "vc$n" down ) &
out=$(FERRY_DEADLINE=3s client_cp 2>&1); rc=$?
printf "exit %s in %d ms: %s\n" "$rc" "$(( $(now_ms) - start ))" "$(last_error "$out")"
if [ "$rc" = 0 ] || [ "$rc" = 124 ] || ! echo "$out" | grep -Eq "\[(timeout|network_error)\]"; then echo "FAIL (d)"; fails=$((fails+1)); fi
ip -n "$C" link set "vc$n" up

echo "== namespaces are removed on exit"
echo "$fails failed, $((4 - fails)) passed"
[ "$fails" = 0 ]
