#!/usr/bin/env bash
# `ferry serve --secret-file` and clients through the CLI on loopback: no secret / wrong secret refused,
# right secret served, `ls` prints names escaped, SIGTERM stops the server gracefully.
set -u
FERRY=${1:?usage: cli_serve_test.sh path/to/ferry}
work=$(mktemp -d)
srv=
cleanup() { [ -n "$srv" ] && kill -9 "$srv" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/export"
printf 'hello ferry\n' > "$work/export/a.txt"
# A name with a newline and a terminal escape in it: `ls` must print it escaped, never raw.
printf 'x' > "$work/export/$(printf 'we\nird\033[31m')"
(umask 077; printf 'the-shared-s3cret-0123\n' > "$work/secret"; printf 'a-wrong-secret-0123456\n' > "$work/wrong")
# Secret files others could read, or short enough to guess, are refused with the fix in the message.
printf 'readable-by-others-0123\n' > "$work/open-secret"; chmod 644 "$work/open-secret"
(umask 077; printf 'short\n' > "$work/short-secret")
"$FERRY" serve --root "$work/export" --listen 127.0.0.1:0 --secret-file "$work/secret" > "$work/serve.log" 2>&1 &
srv=$!
port=
for _ in $(seq 50); do
  port=$(sed -n 's/.* on 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$work/serve.log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "FAIL: server did not start"; cat "$work/serve.log"; exit 1; }
fails=0
check() {  # name, expected regex, command...
  local name=$1 want=$2; shift 2
  out=$("$@" 2>&1)
  if echo "$out" | grep -Eq "$want"; then echo "ok   $name: $(echo "$out" | tail -1 | cut -c1-140)"
  else echo "FAIL $name: $out"; fails=$((fails+1)); fi
}
check "no secret" "requires a shared secret" "$FERRY" stat "ferry://127.0.0.1:$port/a.txt"
check "wrong secret" "authentication refused.*permission_denied" env FERRY_SECRET_FILE="$work/wrong" "$FERRY" stat "ferry://127.0.0.1:$port/a.txt"
check "right secret" "12 bytes" env FERRY_SECRET_FILE="$work/secret" "$FERRY" stat "ferry://127.0.0.1:$port/a.txt"
check "missing secret file" "cannot read the secret file" env FERRY_SECRET_FILE="$work/none" "$FERRY" stat "ferry://127.0.0.1:$port/a.txt"
check "write to read-only" "the server is read-only" env FERRY_SECRET_FILE="$work/secret" "$FERRY" cp host "ferry://127.0.0.1:$port/w.bin" --size 1MiB
check "file API (file:ferry://)" "file engine \(the file itself, its descriptor lent by the server on this host.*\), checksum verified" env FERRY_SECRET_FILE="$work/secret" "$FERRY" cp "file:ferry://127.0.0.1:$port/a.txt" host
check "file API, missing file" "no_such|not_found|No such file.*missing.txt|missing.txt.*No such file" env FERRY_SECRET_FILE="$work/secret" "$FERRY" cp "file:ferry://127.0.0.1:$port/missing.txt" host
check "ls of the root, names escaped" 'file +1  we\\x0aird\\x1b\[31m' env FERRY_SECRET_FILE="$work/secret" "$FERRY" ls "ferry://127.0.0.1:$port/"
check "a secret file others can read" "readable or writable by group or others \(mode 644\); run: chmod 600" "$FERRY" serve --root "$work/export" --listen 127.0.0.1:0 --secret-file "$work/open-secret"
check "a short secret" "only 5 bytes; use at least 16 random bytes: head -c 32 /dev/urandom" "$FERRY" serve --root "$work/export" --listen 127.0.0.1:0 --secret-file "$work/short-secret"
check "a client's secret file others can read" "chmod 600" env FERRY_SECRET_FILE="$work/open-secret" "$FERRY" stat "ferry://127.0.0.1:$port/a.txt"
check "writable without secret" "refusing to serve writable without a shared secret" "$FERRY" serve --root "$work/export" --listen 127.0.0.1:0 --writable
kill -TERM "$srv"
for _ in $(seq 50); do kill -0 "$srv" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$srv" 2>/dev/null; then echo "FAIL: server still running 5 s after SIGTERM"; fails=$((fails+1))
else wait "$srv"; rc=$?; srv=
  if [ "$rc" = 0 ] && grep -q "stopping" "$work/serve.log"; then echo "ok   SIGTERM: $(tail -1 "$work/serve.log")"
  else echo "FAIL SIGTERM: exit $rc"; fails=$((fails+1)); fi
fi
echo "$fails failed"
[ "$fails" = 0 ]
