"""``python -m ferry ARGS`` runs the ferry program (``ferry info``, ``ferry cp``, ``ferry serve``, ...).

An installed package carries it as ``ferry/bin/ferry``. The build tree's package (build/python/ferry) has none:
there ``$FERRY_BINARY`` names it, else the build's own tools/ferry/ferry is used.
"""
import os
import sys
from pathlib import Path
from typing import NoReturn


def _fail(message: str) -> NoReturn:
    print(f"python -m ferry: {message}", file=sys.stderr)
    sys.exit(2)


def _program() -> str:
    here = Path(__file__).resolve().parent
    bundled = here / "bin" / "ferry"
    if bundled.is_file():
        return str(bundled)
    given = os.environ.get("FERRY_BINARY")
    if given:
        if os.access(given, os.X_OK) and os.path.isfile(given):
            return given
        _fail(f"FERRY_BINARY={given} is not an executable file")
    built = here.parent.parent / "tools" / "ferry" / "ferry"  # build/python/ferry -> build/tools/ferry/ferry
    if built.is_file():
        return str(built)
    _fail(f"the ferry program is not in this package ({bundled} is missing); install the package with pip "
          "(README.md, \"Python\") or set FERRY_BINARY to the program")


def main() -> None:
    program = _program()
    # FERRY_BINARY is for this module; the program would warn about it as an unknown FERRY_* setting.
    environ = {name: value for name, value in os.environ.items() if name != "FERRY_BINARY"}
    os.execve(program, [program, *sys.argv[1:]], environ)


if __name__ == "__main__":
    main()
