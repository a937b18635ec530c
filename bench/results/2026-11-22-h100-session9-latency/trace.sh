#!/bin/bash
# Where a 4 KiB QD1 read's time goes now (rdtsc stamps in client and server; a build of this
# commit with stamps added, not the one measured elsewhere).
B=$(pwd)/.device
mkdir -p /tmp/exp/root
export UCX_MODULE_DIR=$B/lib/ucx UCX_TLS=sm,tcp UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y
for i in 1 2; do LD_LIBRARY_PATH=$B/x/traced:$B/lib $B/x/rl3 100000; done
