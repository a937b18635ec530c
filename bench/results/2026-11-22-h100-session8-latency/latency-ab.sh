#!/usr/bin/env bash
# A/B of ferry:// 4 KiB QD1 shm reads (rl2: one client lane, one server worker, 150k reads, p50):
# the library at the session's start (base) vs this session's (new), and new with UCX's default
# rendezvous rails (UCX_MAX_RNDV_RAILS=2: the tcp lane back on shm endpoints).
set -u
B=$(pwd)/.device
mkdir -p /tmp/exp/root
export UCX_MODULE_DIR=$B/lib/ucx UCX_TLS=sm,tcp UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y
for i in 1 2 3 4; do
  for v in base new; do
    L=$B/lib; [ $v = base ] && L=$B/base:$B/lib
    echo "$v: $(LD_LIBRARY_PATH=$L $B/bin/rl2 150000)"
  done
  echo "new+rails2: $(UCX_MAX_RNDV_RAILS=2 LD_LIBRARY_PATH=$B/lib $B/bin/rl2 150000)"
done
