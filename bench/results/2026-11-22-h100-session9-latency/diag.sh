#!/bin/bash
# First call of the session (before any change): machine facts and the traced breakdown, run as
# `bash .device/x/diag.sh` with rl3 (rl3.cpp) and a stamped build of 0fdd903 in .device/x.
B=$(pwd)/.device
export LD_LIBRARY_PATH=$B/x:$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_TLS=sm,tcp UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y
echo "## $(date -u) $(hostname)"
cat /sys/devices/system/clocksource/clocksource0/current_clocksource /sys/devices/system/clocksource/clocksource0/available_clocksource
lscpu 2>/dev/null | grep -E "Model name|Thread|Core|Socket|NUMA|L3|L2|MHz|Hypervisor" ; grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E "tsc|constant|nonstop" | tr '\n' ' '; echo
$B/x/clk   # steady_clock::now() cost, 10M calls
mkdir -p /tmp/exp/root
pt() { # $1 extra env, $2 cpu server, $3 cpu client
  local port=$((20000 + RANDOM % 20000))
  env UCX_TLS=sm $1 taskset -c ${2:-0-15} $B/bin/ucx_perftest -p $port >/dev/null 2>&1 & sleep 0.3
  env UCX_TLS=sm $1 taskset -c ${3:-0-15} $B/bin/ucx_perftest 127.0.0.1 -t ucp_am_lat -s 4096 -n 20000 -w 2000 -p $port -f | tail -1 | awk '{printf "perftest am_lat 4KiB: RTT p50 %.2f us\n", 2*$2}'
  wait
}
for i in 1 2 3; do
  echo "### round $i"
  pt
  echo "L1 W1:"; LANES=1 WORKERS=1 $B/x/rl3 100000
  echo "L4 W4:"; LANES=4 WORKERS=4 $B/x/rl3 100000
  echo "pinned cli 2 srv 4 (L1 W1):"; CPU_CLI=2 CPU_SRV=4,5 LANES=1 WORKERS=1 $B/x/rl3 100000
  echo "perftest pinned 4/2:"; pt "" 4 2
  echo "pinned cli 2 srv 3 (L1 W1):"; CPU_CLI=2 CPU_SRV=3,5 LANES=1 WORKERS=1 $B/x/rl3 100000
  echo "perftest pinned 3/2:"; pt "" 3 2
done
