"""A user's Ctrl-C, for tests: a fresh Python that starts something long, then gets SIGINT."""
import json
import os
import signal
import subprocess
import sys
import time


def ctrl_c(code: str, env: dict | None = None, after: float = 0.5, timeout: float = 60, on_ready=None) -> dict:
    """Runs ``code`` in a new Python; once it prints ``ready``, calls ``on_ready`` (if given) and writes ``go`` to
    its standard input (``code`` reads that line right before its long call), waits ``after`` seconds and sends
    SIGINT, as Ctrl-C does. ``code`` must print one JSON line when the call ends (the
    KeyboardInterrupt caught). Returns that line's object with ``after_signal``, the seconds from the
    signal to the process's end."""
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")
        if on_ready:
            on_ready()
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(after)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=timeout)
        ended = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    got["after_signal"] = ended
    return got
