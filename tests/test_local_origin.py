"""The local API answers only its own Host and origin (issue 56): a web page is a hostile client, even on
127.0.0.1 and even on a --no-auth node. Browsers send "simple" cross-origin POSTs (text/plain) without a
preflight, and DNS rebinding reaches 127.0.0.1 with the page's own name as Host, so the check is one middleware
(provider/local/origin_guard.py) on every method and route, before auth. Through the real daemon
(`provider start --local` in a subprocess) and real clients (httpx, the openai SDK, the command line)."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from provider.logs import THROTTLE_BURST
from provider.local.origin_guard import OriginGuard, _ip, split_host
from provider.settings import Settings, SettingsError
from tools.harness.daemon import LocalServer

EVIL = "http://evil.example"
ALLOWED_ORIGIN = "http://localhost:3000"
ALLOWED_HOST = "node.test"
HTTP = httpx.Client(timeout=60)  # one connection pool: a new client a request costs a TLS context each
LOCAL = Path(__file__).resolve().parent.parent / "provider" / "local"
ROUTE_FILES = (LOCAL / "server.py", LOCAL / "dashboard.py")  # the API's routes and the page's

# Every route the local API serves, with a body that would be served (method, path, JSON body or None).
ROUTES = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("GET", "/v1/responses/{response_id}", None),
    ("DELETE", "/v1/responses/{response_id}", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/tokenizer_info", None),
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("POST", "/provider/v1/generate", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/provider/v1/generate/{job_id}/cancel", None),
    ("POST", "/provider/v1/models/load", {"model": "spare", "keep_alive": -1}),
    ("POST", "/provider/v1/models/unload", {"model": "spare"}),
    ("GET", "/provider/v1/status", None),
    # The node's page (provider/local/dashboard.py).
    ("GET", "/", None),
    ("GET", "/ui/login", None),
    ("POST", "/ui/login-link", None),
    ("GET", "/ui/state", None),
    ("GET", "/ui/app.js", None),
    ("GET", "/ui/charts.js", None),
    ("GET", "/ui/style.css", None),
    ("GET", "/ui/icon.svg", None),
]
# Beside the routes: a preflight, a path nobody serves, a method a route does not take.
OTHERS = [("OPTIONS", "/v1/chat/completions", None), ("GET", "/v1/nothing", None), ("PUT", "/v1/models", None)]


def _config(home: Path, fixtures_dir: Path) -> Path:
    config = home / "config.toml"
    config.write_text(f'cors_origins = "{ALLOWED_ORIGIN}"\nallowed_hosts = "{ALLOWED_HOST}"\n'
                      f'max_resident_models = 3\n[models.spare]\nsource = "{fixtures_dir / "llama-tiny"}"\n')
    return config


@pytest.fixture(scope="module")
def open_node(fixtures_dir, tmp_path_factory):
    """A --no-auth node: nothing but the guard stands between a web page and it."""
    home = tmp_path_factory.mktemp("origin-open")
    srv = LocalServer(fixtures_dir / "qwen3-tiny", home, "--no-auth", "--config", str(_config(home, fixtures_dir)))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def auth_node(fixtures_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("origin-auth")
    srv = LocalServer(fixtures_dir / "qwen3-tiny", home, "--config", str(_config(home, fixtures_dir)))
    yield srv
    assert srv.stop() == 0


def _port(srv) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _send(srv, method, path, body, headers=None, content_type="text/plain"):
    """What a page's fetch() sends without a preflight: the JSON as text/plain."""
    path = path.replace("{response_id}", "resp_x").replace("{job_id}", "job_x")
    content = None if body is None else httpx.Request("POST", "http://x", json=body).content
    h = {"Content-Type": content_type} | srv.headers | (headers or {})
    return HTTP.request(method, srv.url + path, content=content, headers=h)


def _health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=30).json()


def _refused(r, status: int, code: str, path: str) -> None:
    assert r.status_code == status, (path, r.status_code, r.text)
    body = r.json()
    if path.startswith("/v1/messages"):  # Anthropic's error shape on its routes
        assert body["type"] == "error" and body["error"]["type"] == "permission_error", body
    else:
        assert body["error"]["code"] == code and body["error"]["type"] == "permission_error", body


def test_the_route_list_is_every_route_the_server_serves():
    served = {route for f in ROUTE_FILES for route in re.findall(r'web\.(get|post|delete)\("([^"]+)"', f.read_text())}
    assert served == {(m.lower(), p) for m, p, _ in ROUTES}


def test_a_text_plain_post_from_a_foreign_origin_neither_unloads_nor_loads_a_model(open_node):
    """The finding itself: on a --no-auth node, a page's unload and load (keep_alive -1) went through."""
    default = _health(open_node)["default_model"]
    assert default in _health(open_node)["resident_models"]
    for path, body in (("/provider/v1/models/unload", {"model": default}),
                       ("/provider/v1/models/load", {"model": "spare", "keep_alive": -1})):
        for headers in ({"Origin": EVIL}, {"Origin": EVIL + ":" + str(_port(open_node))}, {"Origin": "null"},
                        {"Sec-Fetch-Site": "cross-site"}):
            _refused(_send(open_node, "POST", path, body, headers), 403, "cors_disabled", path)
    resident = _health(open_node)["resident_models"]
    assert default in resident and "spare" not in resident


@pytest.mark.parametrize("method, path, body", ROUTES + OTHERS, ids=lambda x: x if isinstance(x, str) else None)
def test_every_method_and_route_refuses_a_foreign_origin_and_a_foreign_host(open_node, auth_node, method, path,
                                                                            body):
    port = _port(open_node)
    for srv in (open_node, auth_node):
        port = _port(srv)
        for headers, status, code in [
            ({"Origin": EVIL}, 403, "cors_disabled"),
            ({"Origin": f"http://127.0.0.1:{port + 1}"}, 403, "cors_disabled"),  # another local server's page
            ({"Sec-Fetch-Site": "cross-site"}, 403, "cors_disabled"),
            ({"Host": f"evil.example:{port}"}, 403, "host_not_allowed"),  # DNS rebinding
            ({"Host": "evil.example"}, 403, "host_not_allowed"),
            ({"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}, 403, "host_not_allowed"),
            ({"Host": "bad host"}, 400, "invalid_host"),
        ]:
            r = _send(srv, method, path, body, headers)
            if status == 400:
                assert r.status_code == 400 and "Host" in r.text, (path, headers, r.text)
            else:
                _refused(r, status, code, path)
    assert "spare" not in _health(open_node)["resident_models"]


def test_an_absolute_form_target_must_name_the_node_as_its_host_must(open_node):
    """RFC 9112: an absolute-form target's authority stands for the Host; one naming another host was served."""
    port = _port(open_node)
    for target, status in ((f"http://evil.example:{port}/health", b" 403 "),
                           (f"http://127.0.0.1:{port}/health", b" 200 ")):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert status in answer.split(b"\r\n")[0], (target, answer[:300])


def test_a_request_without_a_host_or_with_two_is_refused(open_node):
    for head in ("GET /health HTTP/1.1\r\n", "GET /health HTTP/1.0\r\n",
                 "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"):
        with socket.create_connection(("127.0.0.1", _port(open_node)), timeout=30) as s:
            s.sendall((head + "Connection: close\r\n\r\n").encode())
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), answer[:300]  # aiohttp's parser or the guard


def test_a_malformed_request_is_one_throttled_line_in_the_log_not_a_traceback(open_node):
    """aiohttp logged each malformed request it answered 400 with its whole traceback (17 in the fuzz campaign's
    origin probe): a stranger wrote the node's log at will. Each is one line now, THROTTLE_BURST of them at once."""
    before = len(open_node.logs())
    for _ in range(3 * THROTTLE_BURST):
        with socket.create_connection(("127.0.0.1", _port(open_node)), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nthis line has no colon\r\n\r\n")
            assert s.recv(65536).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    written = open_node.logs()[before:]
    assert "Traceback" not in written, written[:2000]
    assert 1 <= written.count("malformed request refused: BadHttpMessage") <= THROTTLE_BURST, written[:2000]


def test_the_nodes_own_host_and_origin_still_work(open_node, auth_node):
    for srv in (open_node, auth_node):
        port = _port(srv)
        for headers in ({}, {"Host": f"localhost:{port}"}, {"Host": f"127.0.0.1:{port}"}, {"Host": f"[::1]:{port}"},
                        {"Host": "localhost"}, {"Host": "LOCALHOST.:9000"},  # an SSH tunnel's port
                        {"Origin": f"http://127.0.0.1:{port}"}, {"Origin": f"http://localhost:{port}"},
                        {"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}):
            r = _send(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0}, headers,
                      content_type="application/json")
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, (headers, r.text)
            assert httpx.get(srv.url + "/health", headers=headers, timeout=30).status_code == 200


def test_the_openai_sdk_sends_no_origin_and_still_works(open_node, auth_node):
    for srv in (open_node, auth_node):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.token or "none", max_retries=0)
        r = client.chat.completions.create(model=_health(srv)["default_model"], max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "hello"}])
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        assert [m.id for m in client.models.list()]


def test_the_bearer_token_does_not_make_a_foreign_origin_or_host_acceptable(auth_node):
    assert _send(auth_node, "GET", "/v1/models", None).status_code == 200
    _refused(_send(auth_node, "GET", "/v1/models", None, {"Origin": EVIL}), 403, "cors_disabled", "/v1/models")
    _refused(_send(auth_node, "GET", "/v1/models", None, {"Host": "evil.example"}), 403, "host_not_allowed",
             "/v1/models")
    # Without the token, the foreign origin is refused as such (403), never asked for a token (401).
    r = httpx.get(auth_node.url + "/v1/models", headers={"Origin": EVIL}, timeout=30)
    _refused(r, 403, "cors_disabled", "/v1/models")


def test_a_configured_origin_and_host_work_and_keep_cors(open_node):
    port = _port(open_node)
    pre = httpx.options(open_node.url + "/provider/v1/models/load", timeout=30, headers={
        "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    r = _send(open_node, "POST", "/provider/v1/models/load", {"model": "spare", "keep_alive": "1m"},
              {"Origin": ALLOWED_ORIGIN})
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text
    assert r.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "spare" in _health(open_node)["resident_models"]
    r = _send(open_node, "POST", "/provider/v1/models/unload", {"model": "spare"},
              {"Host": f"{ALLOWED_HOST}:{port}", "Origin": f"http://{ALLOWED_HOST}:{port}"})
    assert r.status_code == 200 and r.json()["state"] in ("unloaded", "unloading"), r.text
    assert httpx.get(open_node.url + "/v1/models", headers={"Host": ALLOWED_HOST.upper()}, timeout=30).status_code \
        == 200


def test_the_command_line_over_the_control_socket_is_not_refused(open_node):
    """The control socket (0600; no browser reaches it) sends Host: provider, and needs no exemption by name."""
    for args in (("load", "spare", "--keep-alive", "1m"), ("unload", "spare")):
        r = subprocess.run([sys.executable, "-m", "provider", "models", *args], env=open_node.env,
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr


def test_a_wildcard_bind_answers_its_own_addresses_and_names_only(fixtures_dir, tmp_path):
    srv = LocalServer(fixtures_dir / "qwen3-tiny", tmp_path, "--bind", "0.0.0.0")
    try:
        port = int(srv.url.rsplit(":", 1)[1])
        local = f"http://127.0.0.1:{port}"
        get = lambda base, **h: httpx.get(base + "/v1/models", headers=srv.headers | h, timeout=30)  # noqa: E731
        assert get(local).status_code == 200 and get(local, Host=f"localhost:{port}").status_code == 200
        assert get(local, Host=f"evil.example:{port}").status_code == 403
        if socket.gethostname().lower() != "localhost":  # a loopback connection: localhost and loopback IPs only
            assert get(local, Host=socket.gethostname()).status_code == 403
        lan = next((a.address for addrs in __import__("psutil").net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
        if lan is not None:  # a connection to the machine's LAN address: that address and its host name
            base = f"http://{lan}:{port}"
            assert get(base).status_code == 200
            assert get(base, Host=f"{socket.gethostname()}:{port}").status_code == 200
            assert get(base, Host=f"evil.example:{port}").status_code == 403
            assert get(base, Host=f"localhost:{port}").status_code == 403
    finally:
        assert srv.stop() == 0


def test_the_host_rules_unit():
    g = OriginGuard(Settings(allowed_hosts="mymac.lan"), hostnames=frozenset({"mymac", "mymac.local"}))
    lo, lan, lan6 = _ip("127.0.0.1"), _ip("::ffff:192.168.1.5"), _ip("fe80::1%en0")
    assert [g.host_ok(split_host(h)[0], lo) for h in ("localhost:1", "127.0.0.1", "[::1]:8", "127.0.0.2")] == [True] * 4
    assert [g.host_ok(split_host(h)[0], lo) for h in ("evil.example:8080", "192.168.1.5", "mymac")] == [False] * 3
    assert [g.host_ok(split_host(h)[0], lan) for h in ("192.168.1.5:80", "mymac", "mymac.local", "mymac.lan")] == \
        [True] * 4
    assert [g.host_ok(split_host(h)[0], lan) for h in ("localhost", "127.0.0.1", "192.168.1.6", "a.mymac")] == \
        [False] * 4
    assert g.host_ok("fe80::1", lan6) and not g.host_ok("fe80::2", lan6)
    assert g.origin_ok("http://192.168.1.5:8080", lan, 8080) and not g.origin_ok("https://192.168.1.5:8080", lan, 8080)
    assert not g.origin_ok("http://192.168.1.5", lan, 8080) and g.origin_ok("http://192.168.1.5", lan, 80)
    for bad in ("[::1", "a b", "x:port", "::1", "h:70000", ""):
        assert split_host(bad) is None, bad


@pytest.mark.parametrize("key, value", [("cors_origins", "*"), ("cors_origins", "null"),
                                        ("cors_origins", "http://localhost:3000/app"), ("allowed_hosts", "*"),
                                        ("allowed_hosts", "mymac.lan:8080"), ("allowed_hosts", "http://mymac.lan")])
def test_a_bad_origin_or_host_setting_is_refused_naming_its_key(key, value):
    with pytest.raises(SettingsError, match=f"{key} .*PROVIDER_{key.upper()}"):
        Settings.load(env={f"PROVIDER_{key.upper()}": value})
