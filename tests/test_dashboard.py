"""The node's page (provider/local/dashboard.py) in a real headless browser (Debian's chromium, driven by selenium)
against `provider start --local` on a fixture model: who may see it, that it shows what /health and
`provider status --json` say, a chat answer streaming into it, models the CLI loads and unloads coming and going,
the node restarting under it, and nothing on it driven from another origin. The access and history logic is
checked without a browser."""

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from unittest import mock

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request

from provider.jobs import Claim, Job, SamplingParams
from provider.outputs import Done
from provider.local.dashboard import ASSETS, Dashboard
from provider.local.page_access import CODE_TTL_S, MAX_CODES, SESSION_TTL_S, PageAccess
from provider.local.page_history import History, Reading, histogram_quantile
from tests.helpers import collect, make_node, run
from tools.harness import browser as harness
from tools.harness.daemon import LocalServer

MiB, GiB = 1 << 20, 1 << 30
INF = float("inf")


def shown_bytes(n: int) -> str:
    """app.js's one rule for a byte count."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


# --- without a browser ------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1_800_000_000.0

    def __call__(self):
        return self.t


def test_login_codes_work_once_and_expire():
    clock = Clock()
    access = PageAccess("sk-local-x", clock)
    code = access.mint_code()
    assert access.redeem(code) and not access.redeem(code)  # once
    late = access.mint_code()
    clock.t += CODE_TTL_S + 1
    assert not access.redeem(late)
    codes = [access.mint_code() for _ in range(MAX_CODES + 1)]
    assert not access.redeem(codes[0]) and access.redeem(codes[-1])  # the oldest went first
    assert not access.redeem("") and not access.redeem("x" * 1000)
    assert not PageAccess(None).redeem(PageAccess(None).mint_code())  # no token: no login at all


def test_the_session_cookie_is_bound_to_the_token_and_expires():
    clock = Clock()
    access = PageAccess("sk-local-x", clock)
    cookie = access.new_session()
    assert access.session_ok(cookie)
    assert PageAccess("sk-local-x", clock).session_ok(cookie)  # a restarted node with the same token
    assert not PageAccess("sk-local-y", clock).session_ok(cookie)  # a new token ends every session
    issued, mac = cookie.split(".")
    assert not access.session_ok(f"{int(issued) + 1}.{mac}") and not access.session_ok(mac)
    assert not access.session_ok(None) and not access.session_ok("")
    clock.t += SESSION_TTL_S + 1
    assert not access.session_ok(cookie)


def test_without_a_token_the_page_answers_this_machine_only():
    page = Dashboard(SimpleNamespace(), token=None)

    def request(peer):
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None: {
            "peername": peer, "sockname": ("0.0.0.0", 8080)}.get(name, default)
        return make_mocked_request("GET", "/", transport=transport)

    assert page.signed_in(request(("127.0.0.1", 5000))) and page.signed_in(request(("::1", 5000, 0, 0)))
    assert page.signed_in(request(("::ffff:127.0.0.1", 5000, 0, 0)))
    assert not page.signed_in(request(("192.168.1.20", 5000))) and not page.signed_in(request(None))


def test_histogram_quantile_is_prometheus_estimate():
    buckets = [(0.1, 0.0), (0.25, 50.0), (0.5, 90.0), (1.0, 100.0), (INF, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.25)  # rank 50: the top of (0.1, 0.25]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.175)  # halfway through (0.1, 0.25]
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.99, [(0.1, 1.0), (INF, 10.0)]) == 0.1  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None


def test_history_samples_are_differences_between_readings():
    def reading(t, tokens, prompt, hits, drafted, accepted, forwards, ttft):
        return Reading(t, tokens, prompt, hits, 0, drafted, accepted, forwards, tuple(ttft))

    h = History(size=3)
    h.add(reading(0, 0, 0, 0, 0, 0, 0, [(0.1, 0), (INF, 0)]), 0, 0)
    h.add(reading(5, 500, 1000, 250, 40, 30, 10, [(0.1, 4), (INF, 4)]), 2, 1)
    (s,) = h.since(0)
    assert s["tokens_per_s"] == 100 and s["running"] == 2 and s["queued"] == 1
    assert s["acceptance"] == 0.75 and s["tokens_per_forward"] == 4.0  # (30 accepted + 10 forwards) / 10
    assert s["prefix_hit_share"] == 0.25 and s["ttft_p50_ms"] == pytest.approx(50.0)
    h.add(reading(10, 500, 1000, 250, 40, 30, 10, [(0.1, 4), (INF, 4)]), 0, 0)
    quiet = h.since(1)[0]
    assert quiet["tokens_per_s"] == 0 and quiet["acceptance"] is None and quiet["ttft_p50_ms"] is None
    for t in (15, 20, 25):
        h.add(reading(t, 500, 1000, 250, 40, 30, 10, [(0.1, 4), (INF, 4)]), 0, 0)
    assert [x["seq"] for x in h.since(0)] == [3, 4, 5]  # a ring of 3
    assert [x["seq"] for x in h.since(99)] == [3, 4, 5]  # a page from before a restart gets all of it


def test_assets_are_small_and_fetch_nothing_from_elsewhere():
    files = sorted(ASSETS.iterdir())
    assert sum(f.stat().st_size for f in files) <= 100_000
    for f in files:
        text = f.read_text()
        urls = re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}[^\s\"'`)]*", text, re.I)
        assert urls == [] or set(urls) == {"http://www.w3.org/2000/svg"}, (f.name, urls)
        if f.suffix == ".html":
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), f"inline script in {f.name}"
            assert not re.search(r"\son[a-z]+\s*=", text, re.I), f"inline handler in {f.name}"
            assert not re.search(r"\sstyle\s*=|<style", text, re.I), f"inline style in {f.name}"


def test_the_trust_figures_count_proofs_and_verify_verdicts(fixtures_dir):
    """What the page's Trust card and /metrics show: outcomes with a proof, verify jobs run and their verdicts."""
    node = make_node({"m": fixtures_dir / "gemma4-tiny"}, commitments="on", speculation="off")
    prompt, greedy = (1, 100, 7, 300, 12), SamplingParams(max_tokens=8, temperature=0.0)

    async def main():
        ids, _, done, _ = await collect(node, Job(id="made", model="m", prompt_ids=prompt, sampling=greedy))
        assert isinstance(done, Done) and done.proof is not None
        for job_id, claimed in (("honest", ids), ("changed", ids[:-1] + [ids[-1] + 1])):
            _, _, v, _ = await collect(node, Job(id=job_id, model="m", prompt_ids=prompt, sampling=greedy,
                                                 verify=Claim(tuple(claimed), done.proof)))
            assert isinstance(v, Done) and v.verdict is not None and v.verdict.passed == (job_id == "honest")
        await node.stop()

    run(main())
    c = node.status().counters
    assert c.proofs_made >= 1 and c.verify_jobs == 2 and c.verify_passed == 1
    text = node.metrics.exposition().decode()
    assert 'provider:verify_verdicts_total{verdict="passed"} 1.0' in text
    assert 'provider:verify_verdicts_total{verdict="failed"} 1.0' in text
    assert f"provider:proofs_total {float(c.proofs_made)}" in text


# --- a live node ------------------------------------------------------------------------------


def _needs_browser() -> None:
    why = harness.available()
    if why:
        if os.environ.get("CI"):  # .ci/run installs them: missing there is a failure, not a skip
            pytest.fail(why)
        pytest.skip(why)


def cli(server, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in server.env.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    return subprocess.run([sys.executable, "-m", "provider", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def node(fixtures_dir, tmp_path_factory):
    _needs_browser()
    home = tmp_path_factory.mktemp("dashboard")
    config = home / "config.toml"
    config.write_text(f'[models.extra]\nsource = "{fixtures_dir / "qwen3-tiny"}"\n')
    server = LocalServer(fixtures_dir / "llama-tiny", home, "--config", str(config))
    server.link = harness.login_link(server)  # the one `provider start` printed
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(node):
    """One browser signed in to the node (with the link `provider start` printed, or a new one from
    `provider status --open` when a test on another worker spent it)."""
    b = harness.Browser()
    try:
        link = node.link
        node.link = None
        if link is None:
            r = cli(node, "status", "--open")
            assert r.returncode == 0, r.stderr
            link = r.stdout.strip()
        b.get(link)
        b.wait(lambda: (b.field("link") or "").startswith("live"), "live figures", 15)
        yield b
    finally:
        b.quit()


def live(b) -> bool:
    return (b.field("link") or "").startswith("live")


def test_the_page_refuses_without_the_login_link_and_loads_with_it(node):
    r = httpx.get(node.url + "/")
    assert r.status_code == 401 and "login link" in r.text
    assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
    assert "default-src 'self'" in r.headers["Content-Security-Policy"]
    assert httpx.get(node.url + "/ui/state").status_code == 401
    assert httpx.get(node.url + "/ui/state", headers=node.headers).status_code == 200  # API clients: the token
    link = cli(node, "status", "--open").stdout.strip()
    assert re.fullmatch(re.escape(node.url) + r"/ui/login\?code=[\w-]+", link), link
    with harness.Browser() as b:
        b.get(node.url + "/")
        assert b.field("signin") is not None and b.field("budget") is None  # the sign-in page, no figures
        b.get(link)
        b.wait(lambda: live(b), "live figures", 15)
        assert b.js("return location.pathname + location.search") == "/"  # the code left the address bar
        (cookie,) = b.driver.get_cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
        assert b.js("return document.cookie") == ""  # no script reads it
        b.driver.get_log("browser")  # forget the 401 of the visit before signing in
    with harness.Browser() as other:
        other.get(link)  # spent
        assert other.field("signin") is not None and other.driver.get_cookies() == []
        time.sleep(1.5)
        assert other.field("budget") is None


def _shown(b) -> dict:
    return b.js("""
        const f = (n) => document.querySelector(`[data-field="${n}"]`);
        return {resident: Array.from(document.querySelectorAll('tr[data-model]')).map(r => r.dataset.model),
                available: f('models-available').textContent, budget: f('budget').textContent,
                budget_value: f('budget').dataset.value, reserved: f('reserved').textContent,
                default_model: f('default-model').textContent, completed: f('jobs-completed').dataset.value,
                version: f('version').textContent, pid: f('pid').dataset.value, mode: f('mode').textContent,
                models: Array.from(document.getElementById('chat-model').options).map(o => o.value)};""")


def test_the_figures_equal_health_and_provider_status_json(page, node):
    def agree() -> tuple[bool, str]:
        health = httpx.get(node.url + "/health").json()
        status = json.loads(cli(node, "status", "--json").stdout)
        shown = _shown(page)
        m = health["memory"]
        checks = {
            "resident": shown["resident"] == health["resident_models"] == [
                x["id"] for x in status["models"] if x["state"] == "ready"],
            "models": sorted(shown["models"]) == sorted(health["models"]) == sorted(x["id"] for x in status["models"]),
            "budget": shown["budget"] == shown_bytes(m["usable_bytes"]) == shown_bytes(status["memory"]["usable_bytes"])
            and int(shown["budget_value"]) == m["usable_bytes"] == status["memory"]["usable_bytes"],
            "reserved": shown["reserved"] == shown_bytes(m["reserved_bytes"])
            == shown_bytes(status["memory"]["reserved_bytes"]),
            "default": shown["default_model"] == health["default_model"] == status["default_model"],
            "completed": int(shown["completed"]) == health["counters"]["jobs_completed"]
            == status["counters"]["jobs_completed"],
            "process": int(shown["pid"]) == status["pid"] == node.proc.pid and shown["mode"] == status["mode"],
            "version": shown["version"] == "v" + status["version"],
        }
        return all(checks.values()), f"{checks} {shown} {health} {status}"

    deadline = time.monotonic() + 20  # the status file is rewritten every 2 s: a job just ended may lag
    ok, why = agree()
    while not ok and time.monotonic() < deadline:
        time.sleep(0.5)
        ok, why = agree()
    assert ok, why
    assert "extra" in page.field("models-available")  # served, not loaded


def test_a_chat_answer_streams_into_the_page(page, node):
    before = httpx.get(node.url + "/health").json()["counters"]["jobs_completed"]
    page.js("""
        window.__seen = [];
        const log = document.querySelector('[data-field="chat-log"]');
        new MutationObserver(() => {
            const last = log.querySelector('.msg.assistant:last-of-type');
            const text = last ? last.querySelector('span') : null;
            window.__seen.push([text ? text.textContent.length : 0, !!(last && last.querySelector('.tele'))]);
        }).observe(log, {subtree: true, childList: true, characterData: true});""")
    page.driver.find_element("id", "chat-max").clear()
    page.driver.find_element("id", "chat-max").send_keys("200")
    box = page.driver.find_element("id", "chat-input")
    box.send_keys("Tell me a long story about a lighthouse keeper.")
    box.send_keys("\n")  # Enter sends
    tele = page.wait(lambda: page.field("chat-telemetry"), "the answer's telemetry", 60)
    assert re.search(r"\d+ tokens", tele) and "finish:" in tele and "first token" in tele, tele
    seen = page.js("return window.__seen")
    growing = sorted({n for n, ended in seen if n > 0 and not ended})
    assert len(growing) >= 2, f"the answer did not come in pieces: {seen}"  # streamed, not all at the end
    # Counted in JavaScript as the lengths seen were (UTF-16 units: Python counts an emoji once, JavaScript twice).
    answer = page.js("return document.querySelector('.msg.assistant:last-of-type span').textContent.length")
    assert answer >= growing[-1] > 0
    assert httpx.get(node.url + "/health").json()["counters"]["jobs_completed"] == before + 1
    assert not [e for e in page.console_errors() if "Content Security Policy" in e]


def _row_state(b, model: str):
    return b.js("const r = document.querySelector(`tr[data-model=\"${arguments[0]}\"]`); "
                "return r ? r.dataset.state : null;", model)


def test_a_model_loaded_or_unloaded_by_the_cli_comes_and_goes_within_2_s(page, node):
    assert _row_state(page, "extra") is None
    r = cli(node, "models", "load", "extra")
    assert r.returncode == 0, r.stderr
    page.wait(lambda: _row_state(page, "extra") == "ready", "the loaded model", timeout=2.0)
    r = cli(node, "models", "unload", "extra")
    assert r.returncode == 0, r.stderr
    page.wait(lambda: _row_state(page, "extra") is None, "the unloaded model gone", timeout=2.0)
    assert _row_state(page, "llama-tiny") == "ready"


def test_the_cookie_opens_only_the_pages_own_calls_from_the_page_itself(node):
    link = cli(node, "status", "--open").stdout.strip()
    with httpx.Client() as c:
        assert c.get(link, follow_redirects=True).status_code == 200  # signed in (followed to the page)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        own = {"Origin": node.url, "Sec-Fetch-Site": "same-origin"}
        assert c.get(node.url + "/ui/state", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200
        assert c.post(node.url + "/v1/chat/completions", json=body, headers=own).status_code == 200
        assert c.post(node.url + "/v1/chat/completions", json=body).status_code == 401  # no Origin
        assert c.post(node.url + "/v1/chat/completions", json=body, headers={
            "Origin": "http://evil.example"}).status_code == 403  # the origin guard
        assert c.post(node.url + "/v1/chat/completions", json=body, headers={
            "Origin": "http://127.0.0.1:1"}).status_code == 403  # same site, another origin
        assert c.get(node.url + "/ui/state", headers={"Sec-Fetch-Site": "same-site"}).status_code == 401
        for path in ("/v1/completions", "/ui/login-link", "/provider/v1/models/load", "/metrics"):
            assert c.post(node.url + path, json={}, headers=own).status_code in (401, 405), path


class _Attacker(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args):
        pass


def test_a_page_from_another_origin_cannot_drive_it(page, node):
    """A page on this very machine (same site: 127.0.0.1, another port), open in the signed-in browser, tries the
    page's calls with the browser's cookie: a simple POST (no preflight), a read of the state, a frame."""
    _Attacker.page = f"""<!doctype html><title>waiting</title><iframe id="f" src="{node.url}/"></iframe><script>
        const node = "{node.url}";
        fetch(node + "/v1/chat/completions", {{method: "POST", mode: "no-cors", credentials: "include",
            headers: {{"Content-Type": "text/plain"}},
            body: JSON.stringify({{messages: [{{role: "user", content: "hi"}}], max_tokens: 2}})}})
          .finally(() => fetch(node + "/ui/state", {{credentials: "include"}})
            .then(r => r.text()).then(t => document.title = "READ " + t.slice(0, 40))
            .catch(() => document.title = "BLOCKED"));
        </script>""".encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = httpx.get(node.url + "/health").json()["counters"]
    try:
        page.get(f"http://127.0.0.1:{server.server_address[1]}/")
        page.wait(lambda: page.driver.title != "waiting", "the attacker's page done", 15)
        assert page.driver.title == "BLOCKED"
        time.sleep(0.5)
        after = httpx.get(node.url + "/health").json()["counters"]
        assert after["jobs_completed"] + after["jobs_failed"] == before["jobs_completed"] + before["jobs_failed"]
        refused = [json.loads(x) for x in node.logs().splitlines() if '"http_request"' in x]
        assert any(x["path"] == "/v1/chat/completions" and x["status"] == 403 for x in refused)
        # The frame's request carried no Origin (a navigation) but said same-site: the sign-in page, not the node's
        # (which frame-ancestors 'none' would keep out of a frame anyway).
        assert any(x["path"] == "/" and x["status"] == 401 for x in refused)
    finally:
        server.shutdown()
        page.get(node.url + "/")
        page.wait(lambda: live(page), "live figures again", 15)


CONTRAST = """
    function lum(c) {
        const [r, g, b] = c.match(/[\\d.]+/g).slice(0, 3).map(Number).map(v => {
            v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
        return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    }
    function bg(e) {
        for (; e; e = e.parentElement) {
            const c = getComputedStyle(e).backgroundColor;
            if (c && !c.startsWith('rgba(0, 0, 0, 0)') && c !== 'transparent') return c;
        }
        return 'rgb(255, 255, 255)';
    }
    const out = [];
    for (const e of document.querySelectorAll(arguments[0])) {
        const a = lum(getComputedStyle(e).color), b = lum(bg(e));
        out.push([e.textContent.trim().slice(0, 30), (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)]);
    }
    return out;"""


def test_the_page_is_labelled_readable_and_fits_a_phone(page, node):
    unlabelled = page.js("return Array.from(document.querySelectorAll('input, select, textarea'))"
                         ".filter(e => !document.querySelector(`label[for=\"${e.id}\"]`)).map(e => e.outerHTML)")
    assert unlabelled == []
    assert page.js("return document.documentElement.lang") == "en"
    assert page.js("return Array.from(document.querySelectorAll('.charts svg'))"
                   ".every(s => s.getAttribute('role') === 'img' && s.getAttribute('aria-label'))")
    low = [(t, r) for t, r in page.js(CONTRAST, ".facts dt, .facts dd, .sub, .legend li, .charts .now span, "
                                      "th, td, button, label, .live, .foot p") if t and r < 4.5]
    assert low == [], low
    page.driver.refresh()  # focus as a fresh visit has it: an earlier test of this page may have moved it
    page.wait(lambda: page.js("return document.readyState") == "complete", "the page reloaded")
    page.driver.find_element("tag name", "body").send_keys("\t")  # the keyboard's first stop: the skip link
    assert page.js("return document.activeElement.className") == "skip"
    try:
        page.resize(*harness.PHONE, mobile=True)
        page.wait(lambda: page.js("return window.innerWidth") == harness.PHONE[0], "the phone's width")
        overflow = page.js("return document.documentElement.scrollWidth")
        assert overflow <= harness.PHONE[0], f"the page is {overflow} px wide on a {harness.PHONE[0]} px phone"
    finally:
        page.resize(*harness.DESKTOP)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_page_survives_the_node_restarting(fixtures_dir, tmp_path):
    _needs_browser()
    port = _free_port()
    first = LocalServer(fixtures_dir / "llama-tiny", tmp_path, "--port", str(port))
    second = None
    try:
        link = harness.login_link(first)
        with harness.Browser() as b:
            b.get(link)
            b.wait(lambda: live(b) and b.value("pid") == str(first.proc.pid), "the first process", 15)
            first.stop()
            b.wait(lambda: "does not answer" in b.field("link"), "the node gone", 10)
            second = LocalServer(fixtures_dir / "llama-tiny", tmp_path, "--port", str(port))
            b.wait(lambda: live(b) and b.value("pid") == str(second.proc.pid), "the second process", 15)
            assert b.js("return document.querySelectorAll('tr[data-model=\"llama-tiny\"]').length") == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()
