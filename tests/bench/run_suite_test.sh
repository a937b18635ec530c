#!/usr/bin/env bash
# bench/managed/run-suite with stand-in programs and a stand-in `ferry` (whose `run -- PROG` runs PROG
# with FAKE_FERRY=1): equal results, a result that differs under ferry, a program that fails under
# ferry, one whose stderr lands in the middle of its stdout line (compared on stdout only, so equal),
# a timeout, and a file rule. Each row of the table must say what happened.
set -u
suite=${1:?usage: run_suite_test.sh PATH/TO/run-suite}
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
mkdir -p "$t/bin"
cat >"$t/ferry" <<'X'
#!/bin/sh
[ "$1" = run ] && [ "$2" = -- ] || exit 2
shift 2; FAKE_FERRY=1 exec "$@"
X
cat >"$t/bin/same" <<'X'
#!/bin/sh
sleep 0.1; echo "result 42"; echo "time $$ s"
X
cat >"$t/bin/differs" <<'X'
#!/bin/sh
[ -n "${FAKE_FERRY:-}" ] && echo "result 41" || echo "result 42"
X
cat >"$t/bin/fails" <<'X'
#!/bin/sh
[ -n "${FAKE_FERRY:-}" ] && { echo "aborting" >&2; exit 134; }; echo "result 42"
X
cat >"$t/bin/noisy" <<'X'
#!/bin/sh
sleep 0.1; printf 'result 1 2 3'; [ -n "${FAKE_FERRY:-}" ] && echo "ferry: a log line" >&2; printf ' 4 5\n'
X
cat >"$t/bin/slow" <<'X'
#!/bin/sh
sleep 30; echo "result 42"
X
cat >"$t/bin/writes" <<'X'
#!/bin/sh
sleep 0.1; echo "42" > out.txt
X
chmod +x "$t/ferry" "$t"/bin/*
printf '%s\t-\t%s\t-\t-\t%s\t-\n' same same '^result [0-9]+$' differs differs '^result [0-9]+$' fails fails '^result [0-9]+$' \
  noisy noisy '^result .*$' slow slow '^result [0-9]+$' writes writes 'file:out.txt' >"$t/programs.tsv"
out=$("$suite" "$t/bin" --ferry "$t/ferry" --manifest "$t/programs.tsv" --timeout 2 --out "$t/out" 2>/dev/null)
echo "$out"
fail=0
expect() {  # expect NAME PATTERN: the table's row for NAME matches PATTERN (an extended regex)
  local row; row=$(echo "$out" | grep -E "^$1 " | tail -1)
  echo "$row" | grep -qE "$2" || { echo "FAIL: row of $1 does not match /$2/: $row"; fail=1; }
}
expect same '[0-9.]+ +yes'
expect differs ' NO'
expect fails 'n/a +ferry exit 134'
expect noisy '[0-9.]+ +yes'
expect slow 'n/a +.*timeout'
expect writes '[0-9.]+ +yes'
echo "$out" | grep -q "equal results: 3 of 4 compared" || { echo "FAIL: the summary's count"; fail=1; }
exit $fail
