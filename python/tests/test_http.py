"""http:// and https:// sources, against servers the tests start on loopback: nginx (HTTP/1.1, and HTTPS with a
certificate made for the test; byte ranges) and small Python servers for answers nginx does not give (5xx first,
a stall after the headers). Scenarios that need their own settings (a CA file, short deadlines, small pieces) run
in a fresh process, as the settings apply when a process's runtime is made."""
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ferry
import procs

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, up: bool = True, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            if up:
                return
        except OSError:
            if not up:
                return
        time.sleep(0.02)
    raise AssertionError(f"port {port} not {'up' if up else 'down'} after {timeout} s")


class Nginx:
    def __init__(self, d):
        self.d, self.root = d, d / "root"
        self.root.mkdir()
        (self.root / "slow").mkdir()
        rng = np.random.default_rng(1)
        self.data = rng.integers(0, 256, 20_000_003, dtype=np.uint8)
        (self.root / "data.bin").write_bytes(self.data.tobytes())
        (self.root / "slow" / "data.bin").write_bytes(self.data[:6_000_000].tobytes())
        self.cert, key = d / "cert.pem", d / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(self.cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        self.port, self.tls = free_port(), free_port()
        temp = " ".join(f"{k}_temp_path {d}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # Started by root, nginx's workers would run as nobody, who cannot read the test's private directory.
        user = "user root;" if os.geteuid() == 0 else ""
        (d / "nginx.conf").write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log off;
  {temp}
  server {{ listen 127.0.0.1:{self.port}; root {self.root}; location /slow/ {{ limit_rate 1m; }}
            location /up/ {{ dav_methods PUT; create_full_put_path on; client_max_body_size 0; }} }}
  server {{ listen 127.0.0.1:{self.tls} ssl; ssl_certificate {self.cert}; ssl_certificate_key {key}; root {self.root}; }}
}}
""")
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([NGINX, "-c", str(self.d / "nginx.conf"), "-p", str(self.d)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # fast shutdown: its connections are closed
            self.proc.wait(timeout=10)
        wait_port(self.port, up=False)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def https(self):
        return f"https://127.0.0.1:{self.tls}"


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    if not os.path.exists(NGINX) or not shutil.which("openssl"):
        pytest.skip("nginx and openssl are not installed (scripts/install-deps installs them)")
    n = Nginx(tmp_path_factory.mktemp("web"))
    yield n
    n.stop()


def in_fresh_process(code: str, env: dict, timeout: float = 60) -> dict:
    """Runs ``code`` (which prints one JSON line last) in a new Python with ``env`` added; returns that line."""
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


READ = r"""
import json, sys, time, numpy as np, ferry
url = sys.argv[1] if len(sys.argv) > 1 else None
"""


def test_reads_are_exact_at_odd_offsets_and_sizes(web):
    url = f"{web.url}/data.bin"
    n = len(web.data)
    with ferry.open(url) as f:
        assert f.size == n
        for off, size in [(0, 1), (1, 4095), (4097, 1 << 20), (12_345, 9_000_001), (n - 5, 5), (0, n)]:
            buf = np.zeros(size, dtype=np.uint8)
            assert f.read_into(buf, off) == size
            assert np.array_equal(buf, web.data[off:off + size]), (off, size)
        buf = np.zeros(10, dtype=np.uint8)
        assert f.read_into(buf, n - 3) == 3, "short at the end of the file"
        assert np.array_equal(buf[:3], web.data[-3:])
        assert f.read_into(buf, n) == 0


def test_reads_into_device_memory_go_through_staging(web):
    n = len(web.data)
    dev = ferry.empty(n, "sim:0")
    with ferry.open(f"{web.url}/data.bin") as f:
        assert f.read_into(dev) == n
    back = ferry.empty(n, "pinned")
    ferry.copy(back, dev)
    assert np.array_equal(np.from_dlpack(back), web.data)


def test_a_checkpoint_loads_from_a_web_server(web):
    torch = pytest.importorskip("torch")
    t = {"a": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "b": torch.ones(7, dtype=torch.int64)}
    ferry.safetensors.save(t, web.root / "m.safetensors")
    got = ferry.safetensors.load(f"{web.url}/m.safetensors", progress=False)
    assert set(got) == set(t) and all(torch.equal(got[k], t[k]) for k in t)


def test_bad_requests_are_clear_errors(web):
    with pytest.raises(ferry.Error, match=r"127\.0\.0\.1:\d+/missing\.bin.*HTTP 404") as e:
        ferry.open(f"{web.url}/missing.bin")
    assert e.value.code == "not_found"
    with pytest.raises(ferry.Error, match="not in place") as e:
        ferry.open(f"{web.url}/data.bin", "r+")
    assert e.value.code == "not_supported"
    port = free_port()  # nothing listens there
    with pytest.raises(ferry.Error, match=f"127.0.0.1:{port}/x.bin") as e:
        ferry.open(f"http://127.0.0.1:{port}/x.bin")
    assert e.value.code == "network_error"


def test_a_libcurl_that_cannot_be_loaded_is_named_again_at_every_open():
    # libcurl is loaded at a process's first URL; a failed load is an error naming the library, and a
    # second open (a user's retry) is told the same instead of waiting.
    code = r"""
import json, ferry
said = []
for _ in range(2):
    try:
        ferry.open("http://127.0.0.1:9/x.bin")
    except ferry.Error as e:
        said.append([e.code, str(e)])
print(json.dumps(said))
"""
    said = in_fresh_process(code, {"FERRY_CURL_LIBRARY": "/nonexistent/libcurl.so.4"}, timeout=60)
    assert len(said) == 2
    for code_, text in said:
        assert code_ == "unavailable"
        assert "/nonexistent/libcurl.so.4" in text and "cannot load libcurl" in text


def test_a_file_replaced_after_it_was_opened_fails_its_reads(web):
    p = web.root / "changing.bin"
    p.write_bytes(b"a" * 100_000)
    f = ferry.open(f"{web.url}/changing.bin")
    time.sleep(1.1)  # nginx's ETag is the modification time (seconds) and the size
    p.write_bytes(b"b" * 100_000)
    buf = np.zeros(100_000, dtype=np.uint8)
    with pytest.raises(ferry.Error, match="changed since it was opened"):
        f.read_into(buf)
    f.close()


def test_https_checks_the_certificate(web):
    code = READ + "f = ferry.open(url); b = np.zeros(1 << 20, dtype=np.uint8); f.read_into(b, 7)\n" \
                  "print(json.dumps({'sum': int(b.astype(np.uint64).sum())}))"
    got = in_fresh_process(code.replace("url = sys.argv[1] if len(sys.argv) > 1 else None", f"url = '{web.https}/data.bin'"),
                           {"FERRY_HTTP_CA_FILE": str(web.cert)})
    assert got["sum"] == int(web.data[7:7 + (1 << 20)].astype(np.uint64).sum())
    with pytest.raises(ferry.Error, match="certificate|SSL") as e:
        ferry.open(f"{web.https}/data.bin")  # this process trusts the system's certificates only
    assert e.value.code == "network_error"


def test_a_file_opened_for_writing_is_put_whole(web):
    data = np.random.default_rng(12).integers(0, 256, 9_000_017, dtype=np.uint8)
    url = f"{web.url}/up/dir/a.bin"
    with ferry.open(url, "w") as f:
        f.write_from(data)
        with pytest.raises(ferry.Error, match="one write of the whole file") as e:
            f.write_from(data[:10])
        assert e.value.code == "not_supported"
    assert (web.root / "up" / "dir" / "a.bin").read_bytes() == data.tobytes()
    back = np.zeros(len(data), dtype=np.uint8)
    assert ferry.open(url).read_into(back) == len(data) and np.array_equal(back, data)
    dev = ferry.empty(len(data), "sim:0")  # from device memory: through a staging buffer
    ferry.copy(dev, data[::-1].copy())
    with ferry.open(f"{web.url}/up/b.bin", "w") as f:
        f.write_from(dev)
    assert (web.root / "up" / "b.bin").read_bytes() == data[::-1].tobytes()
    with pytest.raises(ferry.Error, match="offset 0") as e:
        ferry.open(f"{web.url}/up/c.bin", "w").write_from(data[:10], 5)
    with pytest.raises(ferry.Error, match="not in place") as e:
        ferry.open(f"{web.url}/up/b.bin", "r+")
    assert e.value.code == "not_supported"
    with pytest.raises(ferry.Error, match="HTTP 405") as e:  # nginx takes no PUT outside /up/
        ferry.open(f"{web.url}/elsewhere.bin", "w").write_from(data[:10])


class _Ranges(http.server.BaseHTTPRequestHandler):
    """A file with byte ranges, HEAD and an ETag; the first ``fail`` GETs answered 503, or every GET stalled
    after its headers."""
    data, fail, stall, gets, no_head, shift = b"", 0, False, 0, False, 0
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _head(self, code, length, extra=()):
        self.send_response(code)
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", '"v1"')
        self.send_header("Accept-Ranges", "bytes")
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()

    def do_HEAD(self):
        if self.no_head:  # as S3 answers HEAD on a URL presigned for GET
            self._head(403, 0)
            return
        self._head(200, len(self.data))

    def do_GET(self):
        cls = type(self)
        cls.gets += 1
        if cls.gets <= cls.fail:
            self._head(503, 5)
            self.wfile.write(b"later")
            return
        first, last = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        first, last = first + cls.shift, last + cls.shift  # shift: a server that answers another range
        self._head(206, last - first + 1, [("Content-Range", f"bytes {first}-{last}/{len(self.data)}")])
        if cls.stall:
            time.sleep(30)
            return
        self.wfile.write(self.data[first:last + 1])


@pytest.fixture
def ranges():
    handler = type("H", (_Ranges,), {"data": np.random.default_rng(3).integers(0, 256, 3_000_000, dtype=np.uint8).tobytes(),
                                     "fail": 0, "stall": False, "gets": 0, "no_head": False, "shift": 0})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{srv.server_address[1]}/f.bin"
    srv.shutdown()


SUM = READ + ("t0 = time.monotonic()\nf = ferry.open(url); b = np.zeros(f.size, dtype=np.uint8)\n"
              "try:\n    f.read_into(b); out = {'sum': int(b.astype(np.uint64).sum())}\n"
              "except ferry.Error as e:\n    out = {'error': str(e), 'code': e.code}\n"
              "out['seconds'] = time.monotonic() - t0\nprint(json.dumps(out))")


def test_a_server_that_refuses_head_is_sized_by_a_one_byte_get(ranges):
    handler, url = ranges
    handler.no_head = True
    with ferry.open(url + "?X-Amz-Signature=secret") as f:
        assert f.size == len(handler.data)
        buf = np.zeros(len(handler.data), dtype=np.uint8)
        assert f.read_into(buf) == len(buf)
        assert buf.tobytes() == handler.data
    with pytest.raises(ferry.Error) as e:  # messages leave out the query, where a signature is
        ferry.open(f"http://user:pass@127.0.0.1:{free_port()}/x.bin?X-Amz-Signature=secret")
    assert "secret" not in str(e.value) and "pass" not in str(e.value) and "/x.bin" in str(e.value)


def test_an_answer_for_another_range_is_refused(ranges):
    handler, url = ranges
    handler.shift = 10
    buf = np.zeros(1000, dtype=np.uint8)
    with pytest.raises(ferry.Error, match="answered a range from byte 10") as e:
        ferry.open(url).read_into(buf)
    assert e.value.code == "protocol_error" and not buf.any(), "nothing of it lands in the buffer"


def test_5xx_answers_are_tried_again(ranges):
    handler, url = ranges
    handler.fail = 3
    got = in_fresh_process(SUM.replace("url = sys.argv[1] if len(sys.argv) > 1 else None", f"url = {url!r}"),
                           {"FERRY_HTTP_PIECE": "1MiB"})
    assert got.get("sum") == sum(handler.data), got
    assert handler.gets >= 3 + 3, "the three pieces, after three 503s"
    handler.fail, handler.gets = 10**6, 0
    got = in_fresh_process(SUM.replace("url = sys.argv[1] if len(sys.argv) > 1 else None", f"url = {url!r}"),
                           {"FERRY_HTTP_RETRIES": "2"})
    assert got["code"] == "io_error" and "HTTP 503" in got["error"] and re.search(r"/f\.bin offset \d+", got["error"]), got


def test_a_server_that_stalls_after_its_headers_fails_within_the_deadline(ranges):
    handler, url = ranges
    handler.stall = True
    got = in_fresh_process(SUM.replace("url = sys.argv[1] if len(sys.argv) > 1 else None", f"url = {url!r}"),
                           {"FERRY_DEADLINE": "2s"})
    assert got["code"] == "timeout" and "/f.bin offset" in got["error"], got
    assert got["seconds"] < 10, got


CTRL_C = r"""
import json, sys, numpy as np, ferry, ferry.safetensors
f = ferry.open(URL); b = np.zeros(f.size, dtype=np.uint8)
print("ready", flush=True); sys.stdin.readline()
try:
    ferry.safetensors.load(URL, progress=False) if WHOLE else f.read_into(b)
    print(json.dumps({"interrupted": False}))
except KeyboardInterrupt:
    print(json.dumps({"interrupted": True}))
"""


@pytest.mark.parametrize("whole", [False, True], ids=["read_into", "safetensors.load"])
def test_ctrl_c_ends_a_read_from_a_stalled_server_at_once(ranges, whole):
    """The user's Ctrl-C during a read the server stalls: KeyboardInterrupt now, not at the deadline (30 s)."""
    handler, url = ranges
    handler.stall = True
    got = procs.ctrl_c(CTRL_C.replace("URL", repr(url)).replace("WHOLE", str(whole)))
    assert got["interrupted"] and got["after_signal"] < 5, got


def test_a_read_slower_than_the_deadline_still_finishes_while_bytes_move(web):
    """FERRY_DEADLINE is the time without progress, not a budget for the whole read: one range request of 6 MB
    at nginx's 1 MB/s takes about 6 s, three times a deadline of 2 s, and completes."""
    got = in_fresh_process(SUM.replace("url = sys.argv[1] if len(sys.argv) > 1 else None", f"url = '{web.url}/slow/data.bin'"),
                           {"FERRY_DEADLINE": "2s", "FERRY_HTTP_PIECE": "8MiB"})
    assert got.get("sum") == int(web.data[:6_000_000].astype(np.uint64).sum()), got
    assert got["seconds"] > 4, got


def test_a_short_timeout_is_a_window_without_progress_not_a_margin_to_lose(web):
    """A timeout well under half a second still reads from a fast server: the piece ends only a tenth of the
    caller's window before it (not of FERRY_DEADLINE's)."""
    buf = np.zeros(len(web.data), dtype=np.uint8)
    with ferry.open(f"{web.url}/data.bin") as f:
        assert f.read_into(buf, timeout=0.3) == len(buf)
    assert np.array_equal(buf, web.data)


def test_a_server_restarted_mid_read_is_read_on_from_where_it_stopped(web):
    # The reader says when it has opened the file; the server stops once its pieces are under way (not
    # before the open, which a loaded machine may reach later than the pause).
    code = SUM.replace("url = sys.argv[1] if len(sys.argv) > 1 else None", f"url = '{web.url}/slow/data.bin'")
    code = code.replace("f = ferry.open(url); ", "f = ferry.open(url); print('opened', flush=True); ")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FERRY_HTTP_PIECE": "1MiB",
                              "FERRY_HTTP_RETRIES": "8", "FERRY_LOG": "info"})
    try:
        assert p.stdout.readline().strip() == "opened", p.stderr.read()[-2000:] if p.wait(60) is not None else ""
        time.sleep(0.6)  # six pieces at 1 MB/s each: under way
        web.stop()
        time.sleep(0.5)
        web.start()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        if web.proc.poll() is not None:
            web.start()
    assert out.strip(), f"the reader printed nothing (exit {p.returncode}): {err[-3000:]}"
    got = json.loads(out.strip().splitlines()[-1])
    assert got.get("sum") == int(web.data[:6_000_000].astype(np.uint64).sum()), (got, err[-2000:])
    assert "trying again from offset" in err, "the pieces under way were resumed"


S3RVER_VERSION = "3.7.1"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """s3rver (an S3-compatible server, from npm's registry) on loopback with bucket "test"; objects put with the
    curl program (its own SigV4)."""
    npm, curl = shutil.which("npm"), shutil.which("curl")
    if not npm or not curl:
        pytest.skip("npm and curl are not installed (scripts/install-deps installs them)")
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ferry-tests", f"s3rver-{S3RVER_VERSION}")
    server = os.path.join(cache, "node_modules", ".bin", "s3rver")
    if not os.path.exists(server):
        os.makedirs(cache, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", cache, f"s3rver@{S3RVER_VERSION}"],
                       check=True, capture_output=True, timeout=300)
    d = tmp_path_factory.mktemp("s3")
    port = free_port()
    proc = subprocess.Popen([server, "-d", str(d), "-a", "127.0.0.1", "-p", str(port), "--silent", "--configure-bucket", "test"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_port(port)
    endpoint = f"http://127.0.0.1:{port}"

    def put(key: str, data: bytes):
        src = d / "upload.bin"
        src.write_bytes(data)
        subprocess.run([curl, "-sSf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "S3RVER:S3RVER", "-H",
                        "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-T", str(src), f"{endpoint}/test/{key}"],
                       check=True, capture_output=True)

    yield endpoint, put
    proc.terminate()
    proc.wait(timeout=10)


def test_s3_objects_read_with_credentials_from_the_environment_or_the_file(s3, monkeypatch, tmp_path):
    endpoint, put = s3
    data = np.random.default_rng(9).integers(0, 256, 5_000_011, dtype=np.uint8)
    put("dir/an%20object.bin", data.tobytes())
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    with ferry.open("s3://test/dir/an object.bin") as f:
        assert f.size == len(data)
        for off, size in [(0, len(data)), (3, 1_000_003), (len(data) - 7, 7)]:
            buf = np.zeros(size, dtype=np.uint8)
            assert f.read_into(buf, off) == size
            assert np.array_equal(buf, data[off:off + size]), (off, size)
    with pytest.raises(ferry.Error, match=r"s3://test/missing\.bin.*HTTP 404") as e:
        ferry.open("s3://test/missing.bin")
    assert e.value.code == "not_found"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOT-A-KEY")
    with pytest.raises(ferry.Error, match=r"s3://test/dir/an object\.bin.*HTTP 403") as e:
        ferry.open("s3://test/dir/an object.bin")
    assert e.value.code == "permission_denied"
    # Without the environment's keys, the shared credentials file's profile signs (a wrong key there: refused).
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = S3RVER\naws_secret_access_key = S3RVER\n"
                     "[other]\naws_access_key_id = NOT-A-KEY\naws_secret_access_key = x\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    assert ferry.open("s3://test/dir/an object.bin").size == len(data)
    monkeypatch.setenv("AWS_PROFILE", "other")
    with pytest.raises(ferry.Error, match="HTTP 403"):
        ferry.open("s3://test/dir/an object.bin")
    with pytest.raises(ferry.Error, match="expected s3://bucket/key") as e:
        ferry.open("s3://test")
    assert e.value.code == "invalid_argument"


def test_a_checkpoint_saved_to_a_url_loads_back(web):
    torch = pytest.importorskip("torch")
    t = {"a": torch.randn(300, 7), "b": torch.arange(5, dtype=torch.int32), "e": torch.empty(0)}
    ferry.safetensors.save(t, f"{web.url}/up/saved.safetensors")
    got = ferry.safetensors.load(f"{web.url}/up/saved.safetensors", progress=False, verify=True)
    assert set(got) == set(t) and all(torch.equal(got[k], t[k]) for k in t)


def test_s3_objects_are_put_whole(s3, monkeypatch):
    endpoint, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    data = np.random.default_rng(13).integers(0, 256, 6_000_001, dtype=np.uint8)
    with ferry.open("s3://test/put/x y.bin", "w") as f:
        f.write_from(data)
    back = np.zeros(len(data), dtype=np.uint8)
    assert ferry.open("s3://test/put/x y.bin").read_into(back) == len(data)
    assert np.array_equal(back, data)


def test_a_checkpoint_loads_from_s3(s3, monkeypatch):
    torch = pytest.importorskip("torch")
    endpoint, put = s3
    t = {"w": torch.randn(64, 32), "n": torch.arange(10)}
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ferry-s3-{os.getpid()}.safetensors")
    ferry.safetensors.save(t, path)
    try:
        put("m.safetensors", open(path, "rb").read())
    finally:
        os.unlink(path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    got = ferry.safetensors.load("s3://test/m.safetensors", progress=False)
    assert set(got) == set(t) and all(torch.equal(got[k], t[k]) for k in t)


def test_a_large_read_into_device_memory_holds_no_more_host_memory_than_the_staging_pool(web):
    """256 MiB over http:// into sim device memory: the process's peak resident memory grows by the staging pool
    (and libcurl's buffers) at most, not by the file."""
    n = 256 << 20
    with open(web.root / "big.bin", "wb") as f:
        f.write(np.random.default_rng(4).integers(0, 256, n, dtype=np.uint8).tobytes())
    code = READ + f"""
def rss(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) << 10
dev = ferry.empty({n}, 'sim:0')
ferry.copy(dev, np.zeros({n}, dtype=np.uint8))  # the destination's pages made before
before = rss('VmRSS:')
open('/proc/self/clear_refs', 'w').write('5')  # the peak from now on
f = ferry.open('{web.url}/big.bin')
assert f.read_into(dev) == {n}
print(json.dumps({{'grew': rss('VmHWM:') - before, 'pool': (4 << 20) * int(ferry.settings()['FERRY_STAGING_BUFFERS'])}}))
"""
    got = in_fresh_process(code, {"FERRY_SIM_CAPACITY": "1GiB", "FERRY_STAGING_BYTES": "4MiB"})
    os.unlink(web.root / "big.bin")
    assert got["grew"] <= got["pool"] + (48 << 20), got  # 48 MiB: libcurl's buffers, the interpreter's own


class _SigV4(http.server.BaseHTTPRequestHandler):
    """S3's GET and HEAD of one object, each request's AWS Signature Version 4 computed again here from AWS's
    specification (canonical request, string to sign, signing key) and compared: a wrong one is 403. s3rver
    checks only the key id; this checks the signature itself."""
    protocol_version = "HTTP/1.1"
    key, secret, region = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "eu-west-3"
    objects: dict = {}
    seen: list = []

    def log_message(self, *a):
        pass

    def _signature_ok(self) -> bool:
        import hashlib
        import hmac
        import urllib.parse

        auth = self.headers.get("Authorization", "")
        m = re.fullmatch(r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/s3/aws4_request, ?"
                         r"SignedHeaders=([^,]+), ?Signature=([0-9a-f]{64})", auth)
        if not m or m.group(1) != self.key or m.group(3) != self.region:
            return False
        day, signed, got = m.group(2), m.group(4).split(";"), m.group(5)
        if "host" not in signed or "x-amz-date" not in signed or "x-amz-content-sha256" not in signed:
            return False
        path, _, query = self.path.partition("?")
        pairs = sorted(urllib.parse.parse_qsl(query, keep_blank_values=True))
        canonical_query = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}" for k, v in pairs)
        headers = "".join(f"{h}:{' '.join(self.headers.get(h, '').split())}\n" for h in signed)
        canonical = "\n".join([self.command, path, canonical_query, headers, ";".join(signed),
                               self.headers["x-amz-content-sha256"]])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", self.headers["x-amz-date"], scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        k = ("AWS4" + self.secret).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        return hmac.compare_digest(hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest(), got)

    def _answer(self, body: bool):
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization", "")[:16]))
        if not self._signature_ok():
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.objects.get(self.path)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        first, last = 0, len(data) - 1
        if "Range" in self.headers:
            first, last = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        self.send_response(206 if "Range" in self.headers else 200)
        self.send_header("Content-Length", str(last - first + 1 if body else len(data)))
        if "Range" in self.headers:
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("ETag", '"e1"')
        self.end_headers()
        if body:
            self.wfile.write(data[first:last + 1])

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)

    def _request(self):
        """What came (its body, the path and the query), and whether it was signed right."""
        import urllib.parse

        type(self).seen.append((self.command, self.path, self.headers.get("Authorization", "")[:16]))
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        path, _, query = self.path.partition("?")
        return body, path, dict(urllib.parse.parse_qsl(query, keep_blank_values=True)), self._signature_ok()

    def _reply(self, status: int, body: bytes = b"", etag: str = ""):
        self.send_response(status)
        if etag:
            self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        body, path, q, ok = self._request()
        if ok and "uploadId" in q:  # a part of a multipart upload
            if q["partNumber"] in self.fail_parts or q["uploadId"] not in self.uploads:
                return self._reply(403)
            if q["partNumber"] in self.stall_parts:  # takes the part, then answers nothing for a minute
                time.sleep(60)
                return
            self.uploads[q["uploadId"]][int(q["partNumber"])] = body
            return self._reply(200, etag=f'"part{q["partNumber"]}"')
        if ok:
            self.objects[path] = body
        self._reply(200 if ok else 403)

    def do_POST(self):
        body, path, q, ok = self._request()
        if not ok:
            return self._reply(403)
        if "uploads" in q:
            # An id with bytes a query must carry encoded.
            upload = f"up/{len(self.uploads)}+x="
            self.uploads[upload] = {}
            return self._reply(200, f"<InitiateMultipartUploadResult><UploadId>{upload}</UploadId>"
                                    f"</InitiateMultipartUploadResult>".encode())
        if self.refuse_complete:
            return self._reply(400)
        parts = self.uploads.pop(q.get("uploadId"), None)
        listed = re.findall(r"<Part><PartNumber>(\d+)</PartNumber><ETag>([^<]*)</ETag></Part>", body.decode())
        if parts is None or [(int(n), e) for n, e in listed] != [(n, f'"part{n}"') for n in sorted(parts)]:
            return self._reply(400)
        self.objects[path] = b"".join(parts[n] for n in sorted(parts))
        self._reply(200, b"<CompleteMultipartUploadResult></CompleteMultipartUploadResult>")

    def do_DELETE(self):
        _, _, q, ok = self._request()
        self._reply(204 if ok and self.uploads.pop(q.get("uploadId"), None) is not None else 404)


@pytest.fixture
def sigv4(monkeypatch):
    """A _SigV4 server of its own on loopback, and the AWS environment that points s3:// at it."""
    handler = type("S", (_SigV4,), {"objects": {}, "seen": [], "uploads": {}, "fail_parts": set(), "refuse_complete": False,
                                    "stall_parts": set()})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("AWS_REGION", _SigV4.region)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", _SigV4.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", _SigV4.secret)
    yield handler
    srv.shutdown()


def test_s3_signatures_are_aws_signature_version_4(sigv4, monkeypatch):
    handler = sigv4
    data = np.random.default_rng(11).integers(0, 256, 3_000_001, dtype=np.uint8)
    handler.objects["/bkt/a%20dir/w%2Bx.bin"] = data.tobytes()
    with ferry.open("s3://bkt/a dir/w+x.bin") as f:
        buf = np.zeros(len(data) - 5, dtype=np.uint8)
        assert f.read_into(buf, 5) == len(buf)
        assert np.array_equal(buf, data[5:])
    with ferry.open("s3://bkt/new/obj.bin", "w") as f:
        f.write_from(data[:1000])
    assert handler.objects["/bkt/new/obj.bin"] == data[:1000].tobytes()
    assert {c for c, _, _ in handler.seen} == {"HEAD", "GET", "PUT"}
    assert all(a == "AWS4-HMAC-SHA256" for _, _, a in handler.seen), "every request signed"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ferry.Error, match=r"s3://bkt/a dir/w\+x\.bin.*HTTP 403") as e:
        ferry.open("s3://bkt/a dir/w+x.bin")
    assert e.value.code == "permission_denied"


def test_s3_objects_larger_than_a_part_go_up_in_signed_parts(sigv4):
    """Beyond FERRY_HTTP_PIECE (8 MiB) an s3:// write is a multipart upload: started, its parts put in parallel,
    completed with their ETags in order, every request signed (the query strings too). A part the server refuses
    fails the write naming the object and the part's offset, and the upload is let go (aborted)."""
    data = np.random.default_rng(12).integers(0, 256, 20_000_001, dtype=np.uint8)
    with ferry.open("s3://bkt/big/obj.bin", "w") as f:
        f.write_from(data)
    assert sigv4.objects["/bkt/big/obj.bin"] == data.tobytes()
    methods = [c for c, _, _ in sigv4.seen]
    assert methods.count("POST") == 2 and methods.count("PUT") == 3, methods  # 8 + 8 + 3.07 MiB
    assert all(a == "AWS4-HMAC-SHA256" for _, _, a in sigv4.seen), "every request signed"
    assert sigv4.uploads == {}
    back = np.zeros(len(data), dtype=np.uint8)
    assert ferry.open("s3://bkt/big/obj.bin").read_into(back) == len(data) and np.array_equal(back, data)

    sigv4.fail_parts = {"2"}
    with pytest.raises(ferry.Error, match=r"s3://bkt/big/other\.bin \(part 2 of 3, offset 8388608\).*HTTP 403"):
        with ferry.open("s3://bkt/big/other.bin", "w") as f:
            f.write_from(data)
    assert "/bkt/big/other.bin" not in sigv4.objects
    assert sigv4.uploads == {}, "the failed upload was aborted"
    assert "DELETE" in [c for c, _, _ in sigv4.seen]

    # A completion the server refuses: the write fails naming the step, and the upload is aborted too.
    sigv4.fail_parts, sigv4.refuse_complete, sigv4.seen[:] = set(), True, []
    with pytest.raises(ferry.Error, match=r"s3://bkt/big/third\.bin \(completing the multipart upload\).*HTTP 400"):
        with ferry.open("s3://bkt/big/third.bin", "w") as f:
            f.write_from(data)
    assert "/bkt/big/third.bin" not in sigv4.objects and sigv4.uploads == {}
    assert [c for c, _, _ in sigv4.seen][-1] == "DELETE"


def test_a_part_the_server_never_answers_fails_the_upload_within_the_deadline(sigv4):
    """A server that takes a part and then says nothing: the write fails within FERRY_DEADLINE (no progress for
    that long), naming the object and the part, and the upload is aborted; nothing hangs."""
    sigv4.stall_parts = {"2"}
    code = READ + ("data = np.random.default_rng(3).integers(0, 256, 20_000_001, dtype=np.uint8)\n"
                   "t0 = time.monotonic()\n"
                   "try:\n"
                   "    f = ferry.open('s3://bkt/big/stalled.bin', 'w')\n"
                   "    f.write_from(data)\n"
                   "    f.close()\n"
                   "    out = {'ok': True}\n"
                   "except ferry.Error as e:\n"
                   "    out = {'error': str(e), 'code': e.code}\n"
                   "out['seconds'] = time.monotonic() - t0\n"
                   "print(json.dumps(out))")
    got = in_fresh_process(code, {"FERRY_DEADLINE": "2s"})
    assert got.get("code") == "timeout" and "s3://bkt/big/stalled.bin (part 2 of 3" in got["error"], got
    assert got["seconds"] < 10, got
    assert "/bkt/big/stalled.bin" not in sigv4.objects and sigv4.uploads == {}, "aborted"


def test_s3_multipart_from_device_memory(s3, monkeypatch):
    """A multipart upload whose source is device memory (sim): each part staged through pinned buffers."""
    endpoint, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    data = np.random.default_rng(14).integers(0, 256, 18 << 20, dtype=np.uint8)
    dev = ferry.empty(len(data), "sim:0")
    ferry.copy(dev, data)
    with ferry.open("s3://test/parts/from-device.bin", "w") as f:
        f.write_from(dev)
    back = np.zeros(len(data), dtype=np.uint8)
    assert ferry.open("s3://test/parts/from-device.bin").read_into(back) == len(data)
    assert np.array_equal(back, data)


CTRL_C_OPEN = r"""
import json, sys, ferry
ferry.runtime()  # made before the signal can come: the open is what it interrupts
print("ready", flush=True); sys.stdin.readline()
try:
    ferry.open(URL)
    print(json.dumps({"interrupted": False}))
except KeyboardInterrupt:
    print(json.dumps({"interrupted": True}))
"""


def test_ctrl_c_ends_an_open_of_a_server_that_never_answers():
    """ferry.open of a URL whose server takes the connection and never answers the HEAD: Ctrl-C ends it now, not at
    the deadline (30 s)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nothing is ever answered
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/f.bin"
        got = procs.ctrl_c(CTRL_C_OPEN.replace("URL", repr(url)), after=1.0)
        silent.settimeout(5)
        conn, _ = silent.accept()  # the HEAD's connection: the open was under way when the signal came
        conn.close()
    assert got["interrupted"] and got["after_signal"] < 5, got
