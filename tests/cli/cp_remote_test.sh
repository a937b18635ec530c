#!/usr/bin/env bash
# `ferry cp` between any pair of endpoints with a ferry:// side, against `ferry serve` on loopback:
# file -> ferry://, ferry:// -> file, ferry:// -> ferry:// (through host and sim memory), each
# checked by the CLI's own checksum and independently with cmp on the served directory; and the
# errors a user meets (missing remote file, --via with a memory endpoint, same source and destination).
set -u
FERRY=${1:?usage: cp_remote_test.sh path/to/ferry}
work=$(mktemp -d)
srv=
cleanup() { [ -n "$srv" ] && kill -9 "$srv" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/export"
# An odd size (not a multiple of any piece or page) of random bytes.
head -c 3145739 /dev/urandom > "$work/src.bin"
"$FERRY" serve --root "$work/export" --listen 127.0.0.1:0 --writable --insecure > "$work/serve.log" 2>&1 &
srv=$!
port=
for _ in $(seq 100); do
  port=$(sed -n 's/.* on 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$work/serve.log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "FAIL: server did not start"; cat "$work/serve.log"; exit 1; }
remote="ferry://127.0.0.1:$port"
fails=0 passes=0
check() {  # name, expected regex, command...
  local name=$1 want=$2; shift 2
  out=$("$@" 2>&1)
  if echo "$out" | grep -Eq -- "$want"; then echo "ok   $name: $(echo "$out" | tail -1 | cut -c1-160)"; passes=$((passes+1))
  else echo "FAIL $name: $out"; fails=$((fails+1)); fi
}
same() {  # name, file a, file b
  if cmp -s "$2" "$3"; then echo "ok   $1: identical"; passes=$((passes+1))
  else echo "FAIL $1: $2 and $3 differ"; fails=$((fails+1)); fi
}
check "file -> ferry://" "checksum verified" "$FERRY" cp "file:$work/src.bin" "$remote/up.bin"
same "file -> ferry:// (cmp)" "$work/src.bin" "$work/export/up.bin"
check "ferry:// -> file" "UCX \[.*\], [0-9]+ requests? sent, data by .* -> host -> file, checksum verified" env FERRY_NET_FILES=0 "$FERRY" cp "$remote/up.bin" "file:$work/down.bin"
same "ferry:// -> file (cmp)" "$work/src.bin" "$work/down.bin"
check "ferry:// -> file --via sim:0" "-> sim:0 -> file, checksum verified" "$FERRY" cp "$remote/up.bin" "file:$work/down2.bin" --via sim:0
same "ferry:// -> file --via sim:0 (cmp)" "$work/src.bin" "$work/down2.bin"
check "ferry:// -> ferry://" "checksum verified" "$FERRY" cp "$remote/up.bin" "$remote/copy.bin"
same "ferry:// -> ferry:// (cmp)" "$work/src.bin" "$work/export/copy.bin"
check "ferry:// -> ferry:// --via sim:1" "-> sim:1 -> UCX .*checksum verified" "$FERRY" cp "$remote/copy.bin" "$remote/copy2.bin" --via sim:1
same "ferry:// -> ferry:// --via sim:1 (cmp)" "$work/src.bin" "$work/export/copy2.bin"
# Same host, no settings: the server lends the file (on a local file system), read as a local file;
# with FERRY_NET_FILES=0 the data goes through the landing region the server maps; with
# FERRY_NET_MAP=0 it moves in messages.
check "ferry:// -> host, same host" "the file itself, its descriptor lent by the server on this host .*-> host, checksum verified" "$FERRY" cp "$remote/up.bin" host
check "ferry:// -> host, FERRY_NET_FILES=0" "data by mapped landing region -> .*host, checksum verified" env FERRY_NET_FILES=0 "$FERRY" cp "$remote/up.bin" host
check "ferry:// -> host, FERRY_NET_MAP=0" "data by messages -> host, checksum verified" env FERRY_NET_MAP=0 "$FERRY" cp "$remote/up.bin" host
check "file -> ferry:// --size" "part.bin: 1 MiB in .*checksum verified" "$FERRY" cp "file:$work/src.bin" "$remote/part.bin" --size 1MiB
check "missing remote source" "missing.bin.*(No such file|not_found)|(No such file|not_found).*missing.bin" \
  "$FERRY" cp "$remote/missing.bin" "file:$work/never.bin"
check "--via with memory" "--via sim:0: only for copies between files and ferry://" "$FERRY" cp "$remote/up.bin" host --via sim:0
check "same source and destination" "source and destination are the same" "$FERRY" cp "$remote/up.bin" "$remote/up.bin"
echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
