#!/usr/bin/env bash
# The package as a user installs it: `pip install --no-build-isolation` of the repository into a fresh virtual
# environment (offline), then, from another directory and with no PYTHONPATH, `import ferry`, `python -m ferry
# info` (as the ferry program prints it), RUNPATHs relative to the package, and a read into a numpy array.
# The package is taken from this build (FERRY_CMAKE_BUILD_DIR) so that the test does not compile ferry again;
# the install rules, setup.py and the wheel are the same as for a clean `pip install .`.
#   pip_install_test.sh PYTHON SOURCE_DIR BUILD_DIR FERRY_PROGRAM
set -euo pipefail
python=$1 src=$(realpath "$2") build=$(realpath "$3") program=$4

work=$(realpath "$(mktemp -d "${TMPDIR:-/tmp}/ferry-pip-test.XXXXXX")")
trap 'rm -rf "$work"' EXIT
cd "$work"  # not the source tree: `import ferry` must find the installed package, not python/ferry
unset PYTHONPATH LD_LIBRARY_PATH FERRY_BINARY
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1

fail() { echo "FAILED: $*"; exit 1; }

timeout 120 "$python" -m venv --system-site-packages "$work/venv" || fail "$python -m venv (Debian: python3-venv)"
py=$work/venv/bin/python
start=$(date +%s)
FERRY_CMAKE_BUILD_DIR=$build timeout 600 "$py" -m pip install --quiet --no-build-isolation "$src" \
  || fail "pip install --no-build-isolation $src"
echo "pip install: $(($(date +%s) - start)) s"

pkg=$("$py" -c 'import ferry, os; print(os.path.dirname(os.path.realpath(ferry.__file__)))')
case $pkg in "$work/venv/"*) ;; *) fail "import ferry found $pkg, not the installed package" ;; esac
echo "import ferry: $pkg"

# Each binary finds libferry beside it through its RUNPATH, and nothing names the source or the build tree.
lib=$(cd "$pkg" && ls libferry.so.*)
check() {  # FILE (in the package) RUNPATH
  local got deps loaded
  got=$(readelf -d "$pkg/$1" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\2/p')
  [ "$got" = "$2" ] || fail "$1: RUNPATH '$got', want '$2'"
  deps=$(ldd "$pkg/$1")
  ! grep -q "not found" <<<"$deps" || fail "$1: $deps"
  loaded=$(sed -n "s/^[[:space:]]*$lib => \([^ ]*\) .*/\1/p" <<<"$deps")
  [ "$1" = "$lib" ] || [ "$(realpath "$loaded")" = "$pkg/$lib" ] || fail "$1 does not load the package's $lib: $deps"
  ! grep -F -e "$src" -e "$build" <<<"$(readelf -d "$pkg/$1")$deps" || fail "$1 names the source or build tree"
  echo "$1: RUNPATH '$got'$([ "$1" = "$lib" ] || echo ", $lib from the package")"
}
check "$(cd "$pkg" && ls _ferry*.so)" '$ORIGIN'
check bin/ferry '$ORIGIN/..'
check "$lib" ''
check libferry_preload.so '$ORIGIN'

# `python -m ferry info` is the ferry program's `ferry info`.
"$py" -m ferry info > module.txt || fail "python -m ferry info: exit code $?"
"$program" info > program.txt
diff <(head -3 module.txt) <(head -3 program.txt) || fail "python -m ferry info differs from ferry info"
echo "python -m ferry info: exit 0, $(head -1 module.txt)"

# `python -m ferry run` puts the package's preload library into the program's LD_PRELOAD.
preload=$("$py" -m ferry run -- sh -c 'echo "$LD_PRELOAD"') || fail "python -m ferry run: exit code $?"
[ "$preload" = "$pkg/libferry_preload.so" ] || fail "python -m ferry run: LD_PRELOAD '$preload', want $pkg/libferry_preload.so"
echo "python -m ferry run: LD_PRELOAD $preload"

"$py" - <<'PY' || fail "a read into a numpy array"
import numpy as np
import ferry
want = np.random.default_rng(1).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
want.tofile("data.bin")
got = np.empty_like(want)
with ferry.open("data.bin") as f:
    assert f.read_into(got) == want.size
np.testing.assert_array_equal(got, want)
print(f"ferry {ferry.__version__}: read {want.size} bytes into a numpy array, equal")
PY
echo "pip install test: passed"
