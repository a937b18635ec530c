#!/bin/sh
# run_managed.sh FERRY PROGRAM ARGS...: an unmodified program written for managed memory under
# `ferry run`. Passes when the program passes and its memory was ferry's (the preload library says
# so once), not CUDA's; 77 (skipped) when the program finds no GPU.
ferry=$1; shift
out=$(FERRY_LOG=info "$ferry" run -- "$@" 2>&1); rc=$?
printf '%s\n' "$out"
[ "$rc" -eq 77 ] && exit 77
[ "$rc" -eq 0 ] || exit "$rc"
printf '%s\n' "$out" | grep -q "managed memory is ferry's unified memory on cuda" || { echo "run_managed.sh: the managed memory was not ferry's"; exit 1; }
