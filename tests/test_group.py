"""A node group on loopback (issue 24): two ranks started with the documented commands (`provider start --local
--group HOSTFILE --rank 0 --model M`, `provider start --group HOSTFILE --rank 1 --model M`), MLX's ring backend
between them, the model split by mlx-lm's `sharded_load`. Greedy output equals one process of mlx-lm; a client
leaving mid-stream leaves the group serving; a rank killed mid-request ends that request with a typed error,
rank 0 turns unhealthy and exits non-zero; the group started again serves again."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from provider.group.spec import GroupSpecError, group_spec
from tools.harness.group import start_group, write_secret

PROMPTS = ["The cache", "Once upon a time", "def main():", "A B C D", "hello hello", "Numbers: 1 2 3",
           "The quick brown fox", "Why is the sky"]


def reference(model_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """One process of mlx-lm, greedy: the text each prompt continues with."""
    from mlx_lm import generate, load

    model, tok = load(str(model_dir))
    return [generate(model, tok, p, max_tokens=max_tokens) for p in prompts]


def complete(srv, prompt: str, max_tokens: int, **kw) -> dict:
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | kw)
    assert r.status_code == 200, r.text
    return r.json()


def shares(*logs: str) -> list[dict]:
    """Each rank's `group_share_loaded` log event: how it split the model and the weight bytes it holds."""
    return [json.loads(line) for text in logs for line in text.splitlines()
            if line.startswith("{") and '"group_share_loaded"' in line]


def datagrams(sock: socket.socket, enough, timeout: float = 120) -> list[str]:
    """The notify socket's messages, read until `enough(read so far)`; the timeout only bounds a hang."""
    out, deadline = [], time.monotonic() + timeout
    while not enough(out):
        assert time.monotonic() < deadline, f"{len(out)} messages, not enough; the last: {out[-4:]}"
        try:
            out.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    return out


def rank_pings(out: list[str], rank: int) -> int:
    return sum(f"rank {rank} of " in d and "WATCHDOG=1" in d for d in out)


def idle_cpu_per_step(sock: socket.socket, pid: int, steps: int = 3) -> float:
    """CPU seconds a follower spends per step of an idle group, counted by its own watchdog pings: it pings
    from its step loop, at most each WATCHDOG_USEC / 2 (0.5 s here), and an idle group steps once a second, so
    one ping per idle step. CPU time over steps, not over a span of wall time, which load stretches."""
    sock.setblocking(False)
    try:
        while True:
            sock.recv(4096)  # what queued up while the group served: not idle steps
    except BlockingIOError:
        pass
    sock.settimeout(0.5)
    proc = psutil.Process(pid)
    datagrams(sock, lambda out: rank_pings(out, 1) >= 1)
    before = sum(proc.cpu_times()[:2])
    datagrams(sock, lambda out: rank_pings(out, 1) >= steps)
    return (sum(proc.cpu_times()[:2]) - before) / steps


@pytest.mark.heavy
@pytest.mark.parametrize("family,split,expected_split", [("llama-tiny", "auto", "tensor"),
                                                         ("qwen3-tiny", "auto", "tensor"),
                                                         ("qwen2-tiny", "pipeline", "pipeline")])
def test_two_ranks_answer_as_one_process_and_survive_a_client_leaving(fixtures_dir, tmp_path, family, split,
                                                                      expected_split):
    model = fixtures_dir / family
    expected = reference(model, PROMPTS, 24)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # as systemd's, for both ranks' units
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.5)
    leader, followers = start_group(model, tmp_path, 2, "--group-split", split,
                                    env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at once: one batch across both ranks
            got = list(pool.map(lambda p: complete(leader, p, 24), PROMPTS))
        assert [g["choices"][0]["text"] for g in got] == expected
        loaded = shares(leader.logs(), *(f.logs() for f in followers))
        whole = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        assert sorted(e["rank"] for e in loaded) == [0, 1] and {e["split"] for e in loaded} == {expected_split}
        assert all(e["weight_bytes"] < whole for e in loaded), (loaded, whole)  # each rank holds a share
        # A follower under systemd: READY once it serves, then the watchdog fed from its steps (idle ones too).
        datagrams(notify, lambda out: any("rank 1 of 2" in d and "READY=1" in d for d in out)
                  and rank_pings(out, 1) >= 1)
        health = httpx.get(f"{leader.url}/health").json()
        assert health["group"]["ranks"] == 2 and health["group"]["backend"] == "ring"
        spec = httpx.post(f"{leader.url}/v1/completions", headers=leader.headers, timeout=120,
                          json={"prompt": "x", "max_tokens": 2, "speculation": "on"})
        assert spec.status_code == 400 and "not_mtp_capable" in spec.text  # no drafter (test_group_speculation)

        # A client that leaves mid-stream: its row is cancelled on both ranks, and the group serves on.
        with httpx.stream("POST", f"{leader.url}/v1/completions", headers=leader.headers, timeout=120,
                          json={"prompt": "The cache", "max_tokens": 400, "stream": True,
                                "temperature": 0.8}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
        assert complete(leader, PROMPTS[0], 24)["choices"][0]["text"] == expected[0]
        seeded = [complete(leader, "Once", 16, temperature=0.9, seed=7)["choices"][0]["text"] for _ in range(2)]
        assert seeded[0] == seeded[1]  # a seeded sampled job: the same key on every rank, run after run
        assert all(f.proc.poll() is None for f in followers)
        # Idle, a follower sleeps until rank 0 rings (provider.group.doorbell): it waited in MLX's ring
        # collective before, which polls, at 99 % of a core: the whole second between two idle steps (0.37 s of
        # CPU a step beside other tests, 10 ms sleeping).
        per_step = idle_cpu_per_step(notify, followers[0].proc.pid)
        print(f"follower CPU per idle step: {per_step * 1000:.1f} ms")
        assert per_step < 0.1, per_step
    finally:
        assert leader.stop() == 0, leader.logs()[-3000:]
        for f in followers:  # rank 0's stop ends them with it
            assert f.proc.wait(30) == 0, f.logs()[-3000:]
            f.stop()


@pytest.mark.heavy
def test_a_rank_killed_mid_request_ends_it_typed_and_the_restarted_group_serves(fixtures_dir, tmp_path):
    model = fixtures_dir / "llama-tiny"
    no_end = {str(t): -100 for t in json.loads((model / "config.json").read_text())["eos_token_id"]}
    leader, followers = start_group(model, tmp_path / "first")
    try:
        complete(leader, "The cache", 4)
        with httpx.stream("POST", f"{leader.url}/v1/completions", headers=leader.headers, timeout=120,
                          json={"prompt": "The cache", "max_tokens": 1000, "stream": True, "temperature": 0.8,
                                "logit_bias": no_end}) as r:
            lines = r.iter_lines()
            next(lines)
            followers[0].proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events and "error" in events[-1], events[-3:]
        assert events[-1]["error"]["code"] == "group_lost", events[-1]
        assert leader.proc.wait(60) != 0  # it exits for its supervisor, within the minute
        assert time.monotonic() - killed < 60
        assert "engine_failed" in leader.logs()
    finally:
        leader.stop(signal.SIGKILL)
        for f in followers:
            f.stop(signal.SIGKILL)
    leader, followers = start_group(model, tmp_path / "again")
    try:
        assert complete(leader, "The cache", 8)["usage"]["completion_tokens"] >= 1
    finally:
        assert leader.stop() == 0
        for f in followers:
            assert f.proc.wait(30) == 0
            f.stop()


@pytest.mark.heavy
def test_a_stalled_rank_is_found_by_the_watchdog_and_every_rank_exits(fixtures_dir, tmp_path):
    """A rank alive but stopped holds rank 0 inside a collective that never returns: the watchdog ends the job
    typed, rank 0 reports unhealthy and exits; the stalled rank, resumed, finds rank 0 gone and exits too."""
    model = fixtures_dir / "llama-tiny"
    no_end = {str(t): -100 for t in json.loads((model / "config.json").read_text())["eos_token_id"]}
    leader, followers = start_group(model, tmp_path, env={"PROVIDER_GROUP_STEP_TIMEOUT_S": "4"})
    try:
        with httpx.stream("POST", f"{leader.url}/v1/completions", headers=leader.headers, timeout=120,
                          json={"prompt": "The cache", "max_tokens": 1000, "stream": True, "temperature": 0.8,
                                "logit_bias": no_end}) as r:
            lines = r.iter_lines()
            next(lines)
            followers[0].proc.send_signal(signal.SIGSTOP)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "group_lost" and "stalled" in events[-1]["error"]["message"]
        health = httpx.get(f"{leader.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert leader.proc.wait(30) == 69  # EXIT_GROUP_LOST
        followers[0].proc.send_signal(signal.SIGCONT)
        assert followers[0].proc.wait(60) == 69, followers[0].logs()[-2000:]
    finally:
        leader.stop(signal.SIGKILL)
        for f in followers:
            f.proc.send_signal(signal.SIGCONT)
            f.stop(signal.SIGKILL)


def test_the_split_is_the_one_asked_for_or_refused_with_what_would_work():
    from provider.models.loader import choose_split

    assert choose_split("llama", True, False, 8, 4, 2, "auto") == "tensor"
    assert choose_split("qwen2", True, True, 8, 4, 2, "pipeline") == "pipeline"
    assert choose_split("qwen3_next", False, True, 8, 4, 2, "auto") == "pipeline"
    assert choose_split("qwen2", True, True, 6, 3, 4, "auto") == "pipeline"  # heads do not divide: layers do
    for args, message in [(("llama", True, False, 6, 3, 4, "auto"), "do not split evenly over 4 ranks; form"),
                          (("llama", True, False, 8, 4, 2, "pipeline"), "cannot split llama by layers; use .*tensor"),
                          (("qwen3_next", False, True, 8, 4, 2, "tensor"), "projections; use .*pipeline"),
                          (("qwen2", True, True, 6, 3, 4, "tensor"), "or use group_split = \"pipeline\""),
                          (("mamba", False, False, 8, 4, 2, "auto"), "shards neither")]:
        with pytest.raises(ValueError, match=message):
            choose_split(*args)


def test_the_group_is_described_or_refused_with_a_reason(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    secret = str(write_secret(tmp_path / "secret"))
    spec = group_spec(str(hostfile), 1, "ring", {}, secret)
    assert spec.size == 2 and spec.rank == 1 and not spec.leader
    assert group_spec("", -1, "ring", {}) is None
    from_env = group_spec("", -1, "ring", {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "0"}, secret)
    assert from_env.leader and from_env.hostfile == hostfile
    assert Path(secret).read_text().strip() not in repr(spec)  # a spec in a log or traceback never shows it
    with pytest.raises(GroupSpecError, match="provider group init"):
        group_spec(str(hostfile), 1, "ring", {}, str(tmp_path / "no-secret"))
    os.chmod(secret, 0o644)
    with pytest.raises(GroupSpecError, match="can be read by other users"):
        group_spec(str(hostfile), 1, "ring", {}, secret)
    for content, rank, message in [
        ("[[\"127.0.0.1:5000\"]]", 0, "2 to 64 ranks"),
        ("[[\"localhost:5000\"], [\"127.0.0.1:5001\"]]", 0, "not \"ip:port\""),
        ("[[\"127.0.0.1:5000\"], [\"127.0.0.1:5000\"]]", 0, "listed twice"),
        ("[[\"127.0.0.1:5000\"], [\"127.0.0.1:5001\", \"127.0.0.1:5002\"]]", 0, "same number"),
        ("{\"hosts\": []}", 0, "JSON list"),
        ("not json", 0, "is not JSON"),
        ("[[\"127.0.0.1:5000\"], [\"127.0.0.1:5001\"]]", 2, "rank 2 is not in"),
    ]:
        hostfile.write_text(content)
        with pytest.raises(GroupSpecError, match=message):
            group_spec(str(hostfile), rank, "ring", {})
    with pytest.raises(GroupSpecError, match="no rank"):
        group_spec(str(hostfile), -1, "ring", {})
    with pytest.raises(GroupSpecError, match="needs --group"):
        group_spec("", 1, "ring", {})
    with pytest.raises(GroupSpecError, match="cannot read"):
        group_spec(str(tmp_path / "missing.json"), 0, "ring", {})


def test_group_check_measures_each_link_or_names_the_rank_that_is_missing(tmp_path):
    """`provider group check` on every rank: rank 0 reports each link's latency and bandwidth through MLX's ring;
    a rank that never starts, or an address that is not this machine's, is named within the timeout."""
    from tools.harness.group import write_hostfile

    hostfile = write_hostfile(tmp_path / "hosts.json", 2)
    secret = write_secret(tmp_path / "secret")

    def check(rank: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "provider", "group", "check", str(hostfile), "--rank",
                                 str(rank), "--payload-mb", "4", "--group-secret", str(secret), *extra],
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    follower = check(1)
    leader = check(0, "--json")
    out, err = leader.communicate(timeout=120)
    assert leader.returncode == 0, err
    report = json.loads(out)
    assert report["ranks"] == 2 and report["problems"] == [], err
    assert [(link["src"], link["dst"]) for link in report["links"]] == [(0, 1)]
    assert report["links"][0]["latency_ms_p50"] > 0 and report["links"][0]["bandwidth_gb_s"] > 0
    assert follower.wait(60) == 0 and "rank 0 prints the report" in follower.stdout.read()

    alone = check(0, "--timeout", "2")
    _, err = alone.communicate(timeout=60)
    assert alone.returncode == 69 and "did not hear from rank 1 (127.0.0.1:" in err
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["192.0.2.1:5001"]]))  # TEST-NET: never this machine
    elsewhere = check(1, "--timeout", "2")
    _, err = elsewhere.communicate(timeout=60)
    assert elsewhere.returncode == 69 and "cannot listen on 192.0.2.1:5001" in err


def test_ranks_meet_in_any_order_and_leave_their_ports_free_or_name_who_is_missing(tmp_path):
    """The rendezvous before MLX's init, three ranks on loopback started at different times: each returns once
    all have met, with its listener closed (MLX binds the same port next); a rank that never comes is named."""
    import threading

    from provider.group.rendezvous import RendezvousError, meet
    from tools.harness.group import write_hostfile

    hostfile = write_hostfile(tmp_path / "hosts.json", 3)
    secret = str(write_secret(tmp_path / "secret"))
    specs = [group_spec(str(hostfile), r, "ring", {}, secret) for r in range(3)]
    errors: list[BaseException] = []

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        try:
            meet(specs[r], 20)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r, d)) for r, d in ((2, 0.0), (0, 0.3), (1, 0.6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    for spec in specs:  # every listener closed, no connection left on the port: it binds again at once
        host, port = spec.hosts[spec.rank][0].rsplit(":", 1)
        with socket.socket() as s:
            s.bind((host, int(port)))

    threads = [threading.Thread(target=lambda r=r: errors.append(_missing(meet, specs[r]))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(e, RendezvousError) and f"rank 2 ({specs[2].hosts[2][0]})" in str(e) for e in errors)


def _missing(meet, spec) -> BaseException | None:
    try:
        meet(spec, 1.5)
    except BaseException as e:
        return e
    return None
