#!/bin/bash
# A/B of ferry:// 4 KiB QD1 shm reads (rl2: 150k reads, p50 and start_read p50): the library at
# this session's start (base, 0fdd903) vs now (new), one lane + one server worker, and now with
# 4 lanes + 4 workers (the defaults). Alternating, 4 rounds; perftest's 4 KiB AM RTT each round.
B=$(pwd)/.device
mkdir -p /tmp/exp/root
export UCX_MODULE_DIR=$B/lib/ucx UCX_TLS=sm,tcp UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y
echo "# $(date -u +%FT%TZ) $(hostname)"
for i in 1 2 3 4; do
  port=$((20000 + RANDOM % 20000))
  (UCX_TLS=sm LD_LIBRARY_PATH=$B/lib $B/bin/ucx_perftest -p $port >/dev/null 2>&1 &) ; sleep 0.3
  UCX_TLS=sm LD_LIBRARY_PATH=$B/lib $B/bin/ucx_perftest 127.0.0.1 -t ucp_am_lat -s 4096 -n 20000 -w 2000 -p $port -f | tail -1 | awk '{printf "perftest am_lat 4 KiB RTT p50 %.2f us\n", 2*$2}'
  sleep 0.3
  echo "base L1W1: $(LD_LIBRARY_PATH=$B/base:$B/lib $B/x/rl2 150000)"
  echo "new  L1W1: $(LD_LIBRARY_PATH=$B/lib $B/x/rl2 150000)"
  echo "new  L4W4: $(LANES=4 WORKERS=4 LD_LIBRARY_PATH=$B/lib $B/x/rl2 150000)"
done
