"""The README's Python snippet, exactly as written, in a fresh shell and an empty directory."""
import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def snippet() -> str:
    text = open(README).read()
    python = text[text.index("\n## Python\n"):]
    m = re.search(r"\n    python3 - <<'PY'\n(.*?\n)    PY\n", python, re.S)
    assert m, "README's Python section has no python3 heredoc"
    return "python3 - <<'PY'\n" + "".join(line[4:] + "\n" for line in m.group(1).splitlines()) + "PY\n"


def test_the_readme_snippet_runs_as_written(tmp_path):
    # `python3` is this interpreter (the one the package was built for), first on PATH.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python3")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(["bash", "-c", snippet()], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "['b', 'w'] (1024, 256)" in out.stdout, out.stdout
    assert (work / "model.safetensors").exists()
