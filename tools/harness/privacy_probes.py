"""Issue 56's probes against a live node (`provider start --local --coordinator`, the bundled model), beside its
floods (tools/harness/floods.py): what an attacker one step outside the tests would try.

- sealed: a sealed job's 700 prompt ids, then unsealed and sealed probes in its cache scope sharing its first
  700 (the whole prompt), 600 and 300 ids; every probe must be told 0 cached tokens. A control (an unsealed
  prompt, then the same again) must be told it hit, or the probes prove nothing.
- origin: every route and method with a foreign Origin, `Sec-Fetch-Site: cross-site`, a rebinding Host (another
  name, the node's port) and a missing Host, the token attached as a page cannot; none may be served (2xx) nor
  reach a handler's work. A control without them must be served.
- planted files: the disk tier's own entries rewritten without its key, each also shadowed by a symlink to
  /dev/zero, a FIFO and a sparse 1 GiB file under entry names, planted while the node is down; after a restart
  the same long prompt must be served nothing from disk, the planted files and the entry it looked up removed
  and counted, and its text the same as the first run's.
"""

from __future__ import annotations

import http.client
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from coordinator_client.pb import provider_pb2 as pb

ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/messages"),
          ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
          ("DELETE", "/v1/responses/resp_x"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/tokenizer_info"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
          ("POST", "/provider/v1/generate"), ("POST", "/provider/v1/models/load"),
          ("POST", "/provider/v1/models/unload"), ("GET", "/provider/v1/status")]


@dataclass
class ProbeReport:
    sealed: dict = field(default_factory=dict)  # probe -> cached prompt tokens it was told
    origin_served: list = field(default_factory=list)  # (method, path, attack, status) served with a 2xx
    origin_refused: int = 0
    origin_control: int = 0  # the control's status
    planted: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        s, p = self.sealed, self.planted
        sealed_ok = bool(s) and s.get("control", 0) > 0 and all(v == 0 for k, v in s.items() if k != "control")
        planted_ok = (bool(p) and p.get("disk_hit") is False and p.get("same_tokens") is True
                      and not any("planted" in name for name in p.get("left", ["?planted"]))
                      and p.get("refused", 0) >= 4 and p.get("alive") is True)
        return sealed_ok and not self.origin_served and 200 <= self.origin_control < 300 and planted_ok

    def lines(self) -> list[str]:
        return [f"sealed prompt: cached tokens told to each probe {self.sealed} (control must be > 0, the rest 0)",
                f"cross-origin and rebinding: {self.origin_refused} refused, {len(self.origin_served)} served "
                f"{self.origin_served[:5]}; control {self.origin_control}",
                f"planted disk files: {self.planted}"]


def sealed_probe(coord, call, session) -> dict:
    """Cached tokens each probe is told (sealed secret first, then probes in its scope), and a control."""
    rng = random.Random(56)
    secret = [rng.randrange(3, 250) for _ in range(700)]  # past two prefix blocks (256 tokens each)
    public = [rng.randrange(3, 250) for _ in range(700)]

    def cached(job_id: str, ids: list[int], sealed: bool, scope: str) -> int:
        req = pb.JobRequest(job_id=job_id, model="gemma4-demo", max_tokens=2, prompt_ids=pb.PromptTokens(ids=ids),
                            sampling=pb.SamplingParams(temperature=0.0), cache_scope=scope)
        (coord.dispatch_sealed if sealed else coord.dispatch)(session, req)
        frame = call(coord.outcome(job_id))
        if frame.WhichOneof("frame") != "job_done":
            raise RuntimeError(f"probe {job_id} did not finish: {frame}")
        return frame.job_done.usage.cached_prompt_tokens

    out = {}
    for n in (700, 600, 300):  # 700: the very prompt, the one a sliding-window model's cache can serve
        scope = f"p56-{n}"
        cached(f"p56-sealed-{n}", secret, True, scope)
        out[f"unsealed probe {n}"] = cached(f"p56-probe-{n}", secret[:n] + public[:100], False, scope)
        out[f"sealed probe {n}"] = cached(f"p56-sprobe-{n}", secret[:n] + public[100:200], True, scope)
    out["unsealed probe, no scope"] = cached("p56-probe-x", secret[:600] + public[:100], False, "")
    cached("p56-public", public, False, "p56-public")
    out["control"] = cached("p56-public-again", public, False, "p56-public")
    return out


def _raw(url: str, method: str, path: str, headers: dict, body: bytes | None) -> int:
    """One request with exactly these headers (http.client: Host as given, or none at all)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        return conn.getresponse().status
    finally:
        conn.close()


def origin_probe(url: str, auth: dict, report: ProbeReport) -> None:
    port = urlsplit(url).port
    own = f"127.0.0.1:{port}"
    body = json.dumps({"model": "gemma4-demo", "max_tokens": 1, "prompt": "Hi", "input": "Hi", "text": "Hi",
                       "messages": [{"role": "user", "content": "Hi"}], "tokens": [5]}).encode()
    attacks = {"foreign origin": {"Host": own, "Origin": "http://evil.example"},
               "null origin": {"Host": own, "Origin": "null"},
               "cross-site fetch": {"Host": own, "Sec-Fetch-Site": "cross-site"},
               "rebinding host": {"Host": f"evil.example:{port}"},
               "rebinding host, own origin": {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"},
               "no host": {}}
    for method, path in ROUTES:
        for name, headers in attacks.items():
            h = {**headers, **auth, "Content-Type": "text/plain"}
            status = _raw(url, method, path, h, body if method == "POST" else None)
            if 200 <= status < 300:
                report.origin_served.append((method, path, name, status))
            else:
                report.origin_refused += 1
    report.origin_control = _raw(url, "GET", "/v1/models", {"Host": own, **auth}, None)


def long_prompt_ids() -> list[int]:
    rng = random.Random(5656)
    return [rng.randrange(3, 250) for _ in range(700)]  # past a prefix block, so the disk tier keeps it


def run_long(url: str, auth: dict) -> tuple[str, int]:
    """The long prompt through /v1/completions with token ids: (its text, cached prompt tokens)."""
    r = httpx.post(url + "/v1/completions", headers=auth, timeout=120, json={
        "model": "gemma4-demo", "prompt": long_prompt_ids(), "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    data = r.json()
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    return data["choices"][0]["text"], int(details.get("cached_tokens") or 0)


def disk_dir(home: Path) -> Path:
    return home / "cache" / "provider" / "prefix-cache"  # LocalServer's XDG_CACHE_HOME, the default tier dir


def planted_probe(srv, restart, auth_of) -> dict:
    """The long prompt run, the node stopped, its entries rewritten and hostile files planted, the node
    restarted by `restart()` (the same home) and the prompt run again."""
    root = disk_dir(srv.home)
    before = set(root.glob("*.pxkv"))
    first, _ = run_long(srv.url, auth_of(srv))
    srv.stop()  # the writer's queue is flushed on the way out
    written = sorted(set(root.glob("*.pxkv")) - before)
    if not written:
        return {"error": "the disk tier wrote no entry for the long prompt"}
    plant_names = [root / f"{'%064x' % random.Random(i).getrandbits(256)}.pxkv" for i in range(3)]
    planted = plant_files(written, plant_names)
    srv = restart()
    again, cached = run_long(srv.url, auth_of(srv))
    health = httpx.get(srv.url + "/health", headers=auth_of(srv), timeout=60).json()
    disk = health.get("prefix_disk") or {}
    # A rewritten entry the second run never looked up (a shorter block of the same prompt) stays until it is read.
    left = [p.name[:8] + ("(entry)" if p in written else "(planted)") for p in [*written, *plant_names]
            if os.path.lexists(p)]
    return {"srv": srv, "planted": planted, "disk_hit": cached > 0, "same_tokens": again == first,
            "refused": disk.get("refused_files", 0), "left": left, "alive": srv.proc.poll() is None}


def plant_files(entries: list[Path], names: list[Path]) -> int:
    """Each entry rewritten without the tier's key (its payload's tail flipped: a MAC over it no longer holds),
    and a symlink to /dev/zero, a FIFO and a sparse 1 GiB file under entry names."""
    for f in entries:
        data = bytearray(f.read_bytes())
        for i in range(max(0, len(data) - 64), len(data)):
            data[i] ^= 0x5A
        f.write_bytes(bytes(data))
    os.symlink("/dev/zero", names[0])
    os.mkfifo(names[1])
    with open(names[2], "wb") as f:
        f.truncate(1 << 30)  # sparse: reading it whole would cost a gibibyte
    return len(entries) + len(names)
