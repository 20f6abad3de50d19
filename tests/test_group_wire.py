"""The node group's own wire against an attacker (issue 36): rank 0's plans as sealed, numbered JSON (no pickle,
nothing made by name), the rendezvous and the wake-up port proven by challenge–response under the group's
secret. Plain sockets and pure functions: no MLX here (tests/test_group_hostile.py runs the real ranks)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pickle
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import structlog

from provider.engine.collective import GroupLost
from provider.group import handshake
from provider.group.doorbell import Doorbell, accept_followers, dial_leader
from provider.group.link import seal, unseal
from provider.group.plan import CancelRow, PlanError, StartRow, decode_plan, encode_plan
from provider.group.rendezvous import meet
from provider.group.secret import GroupKey
from provider.group.spec import group_spec, public_addresses
from provider.types import SpecMode
from tests.helpers import until_blocking
from tools.harness.group import loopback_specs, write_secret
from tools.harness.plans import CHAT_LINE, a_plan

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512


@pytest.fixture
def key(tmp_path) -> GroupKey:
    return GroupKey(bytes(range(32)), (("127.0.0.1:1",), ("127.0.0.1:2",)))


def test_a_plan_crosses_as_json_and_comes_back_the_same(key):
    plan = a_plan()
    sealed = seal(key, 7, "plan", encode_plan(plan))
    got = decode_plan(unseal(key, 7, "plan", sealed), VOCAB)
    start, want = got.changes[0], plan.changes[0]
    assert isinstance(start, StartRow) and got.changes[1] == CancelRow("job-0") and not got.stop
    assert (start.prompt, start.max_tokens, start.shared_prefix) == (want.prompt, want.max_tokens, want.shared_prefix)
    assert start.job.sampling == want.job.sampling and start.job.rules == want.job.rules
    assert (start.job.id, start.job.model, start.job.speculation) == (want.job.id, want.job.model, want.job.speculation)
    assert (start.plan.mode, start.plan.reason, start.plan.k) == (SpecMode.OFF, "group_mode", 0)
    assert CHAT_LINE.encode() not in sealed  # the chat stays on rank 0: followers get the rendered ids


def test_no_pickle_on_the_groups_wire():
    """Plans travelled as pickles, and `("provider.service_files", "subprocess.Popen")` ran a command on every
    worker: nothing under provider/group may unpickle (or import pickle at all)."""
    for path in (ROOT / "provider" / "group").glob("*.py"):
        names = {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names} | {n.module for n in ast.walk(ast.parse(path.read_text()))
                                      if isinstance(n, ast.ImportFrom)}
        assert not names & {"pickle", "marshal", "shelve", "dill", "cloudpickle"}, path


@pytest.mark.parametrize("gadget", ["subprocess.Popen", "io.FileIO"])
def test_the_review_gadgets_are_refused_and_never_run(key, tmp_path, gadget, monkeypatch):
    """The review's gadgets, as an on-path attacker would send them, and even sealed under the group's own key
    (a rank that holds the secret but is compromised): refused, the group stops, nothing runs."""
    marker = tmp_path / "ran"

    class Gadget:
        def __reduce__(self):
            if gadget == "subprocess.Popen":
                return subprocess.Popen, (["touch", str(marker)],)
            import io
            return io.FileIO, (str(marker), "w")

    raw = pickle.dumps(Gadget(), protocol=4)
    # Whether a gadget ran is known at once: FileIO makes the marker as it is called, and Popen (looked up by
    # name as the pickle is read) is recorded here instead of starting a process whose file would come later.
    ran = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: ran.append(a))
    for message in (raw, key.tag("x") + raw, seal(key, 0, "plan", {"x": 1})[:-32 - 7] + raw):
        with pytest.raises(GroupLost, match="not the group's|not proven"):
            unseal(key, 0, "plan", message)
    # Sealed by a rank that holds the key: the body is still only JSON to the follower.
    head = b"PGM1" + (0).to_bytes(8, "little") + bytes([4]) + b"plan"
    with pytest.raises(GroupLost, match="not a JSON object"):
        unseal(key, 0, "plan", head + raw + key.tag("message", 0, "plan", raw))
    assert not ran and not marker.exists()
    pickle.loads(raw)  # what the check would see had the gadget run
    assert ran or marker.exists()


def test_a_forged_altered_replayed_or_reordered_message_is_refused(key):
    body = encode_plan(a_plan())
    good = seal(key, 3, "plan", body)
    hosts = (("127.0.0.1:1",), ("127.0.0.1:2",))
    stranger = GroupKey(bytes(32), hosts)
    other_group = GroupKey(bytes(range(32)), hosts + (("127.0.0.1:3",),))
    flipped = bytearray(good)
    flipped[40] ^= 1
    cases = {"forged": seal(stranger, 3, "plan", body), "another group": seal(other_group, 3, "plan", body),
             "altered": bytes(flipped), "another kind": seal(key, 3, "port", body), "truncated": good[:20],
             "empty": b""}
    for name, message in cases.items():
        with pytest.raises(GroupLost, match="not proven|not the group's"):
            unseal(key, 3, "plan", message)
    for expected in (2, 4):  # replayed (already seen) or reordered (from the future)
        with pytest.raises(GroupLost, match="out of order"):
            unseal(key, expected, "plan", good)
    assert unseal(key, 3, "plan", good) == json.loads(json.dumps(body))


@pytest.mark.parametrize("damage", [
    lambda p: p.update(extra=1),
    lambda p: p.update(stop=1),  # an int is not a bool here
    lambda p: p["changes"][0]["start"].update(prompt=[VOCAB]),  # outside the vocabulary: native code would crash
    lambda p: p["changes"][0]["start"].update(prompt=[]),
    lambda p: p["changes"][0]["start"].update(shared_prefix=99),
    lambda p: p["changes"][0]["start"]["sampling"].update(temperature=5.0),
    lambda p: p["changes"][0]["start"]["sampling"].update(top_k=-1),
    lambda p: p["changes"][0]["start"]["sampling"].update(evil="__import__('os')"),
    lambda p: p["changes"][0]["start"]["rules"]["tools"][0].update(name="no spaces allowed"),
    lambda p: p["changes"][0]["start"]["spec"].update(mode="warp"),
    lambda p: p["changes"][0]["start"].update(id="x" * 10_000),
    lambda p: p.update(changes=[{"cancel": 5}]),
    lambda p: p.update(changes=[{"start": None}]),
])
def test_a_plan_that_says_what_no_request_could_is_refused(damage):
    raw = json.loads(json.dumps(encode_plan(a_plan())))
    damage(raw)
    with pytest.raises(PlanError):
        decode_plan(raw, VOCAB)


def _raise_nofile(at_least: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < at_least:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, at_least), hard))


def _attack(address: str, stop: threading.Event, foreign: GroupKey, held: list[socket.socket]) -> None:
    """What the review tried at a rank's rendezvous port, and a thousand connections more, held open."""
    host, port = address.rsplit(":", 1)
    hello = lambda rank, k: handshake.hello_line(k, "rendezvous", rank, 1, b"\0" * 16, b"\1" * 16)  # noqa: E731
    lines = [b"provider-group/1 \xc2\xb2\n", "provider-group/2 ²\n".encode(), b"provider-group/2 1 " + b"0" * 32 +
             b" " + b"0" * 64 + b"\n", hello(0, foreign), b"x" * 4096, b"", hello(99, foreign)]
    for i in range(1000):
        if stop.is_set():
            return
        try:
            conn = socket.create_connection((host, int(port)), timeout=2)
        except OSError:
            time.sleep(0.01)
            continue
        line = lines[i % len(lines)]
        try:
            if line:
                conn.sendall(line)
        except OSError:
            pass
        held.append(conn)  # held open: a rank that never proves itself


def test_a_hostile_peer_never_stops_honest_ranks_meeting(tmp_path):
    """Malformed hellos (the review's '²'), a foreign group's, one claiming the listener's own rank, connections
    held open, and a thousand connections: the two honest ranks still meet, and neither raises."""
    _raise_nofile(4096)
    specs = loopback_specs(tmp_path, 2)
    foreign = GroupKey(bytes(32), specs[0].hosts)
    stop, held, errors = threading.Event(), [], []
    attackers = [threading.Thread(target=_attack, args=(specs[r].hosts[r][0], stop, foreign, held))
                 for r in (0, 1)]

    def rank(r: int) -> None:
        try:
            meet(specs[r], 60)
        except BaseException as e:
            errors.append(e)

    ranks = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    with structlog.testing.capture_logs() as logged:
        ranks[0].start()
        attackers[0].start()  # it dials until rank 0 listens
        # The attack is under way at rank 0 before rank 1 comes (its attacker dials until it listens).
        until_blocking(lambda: len(held) >= 20, "the attack never reached rank 0")
        ranks[1].start()
        attackers[1].start()
        for t in ranks:
            t.join(90)
    stop.set()
    for t in attackers:
        t.join(30)
    for conn in held:
        conn.close()
    assert not errors and not any(t.is_alive() for t in ranks), errors
    assert len(held) > 100  # the attack really reached the ports
    refused = [e for e in logged if e["event"] == "group_connection_refused"]
    assert {"malformed hello", "not a provider group's hello", "rank 0 cannot say hello to rank 0 here"} \
        <= {e["reason"] for e in refused}
    assert len(refused) <= 2 * (handshake.LOGGED_REFUSALS + 1)  # a flood is counted, not logged line by line


def test_ranks_with_different_secrets_never_meet_and_say_why(tmp_path):
    specs = loopback_specs(tmp_path, 2)
    other = group_spec(str(specs[1].hostfile), 1, "ring", {}, str(write_secret(tmp_path / "other")))
    errors: list[BaseException] = []

    def rank(spec) -> None:
        try:
            meet(spec, 3)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(s,)) for s in (specs[0], other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 2 and all("did not hear from" in str(e) for e in errors)
    assert any("not proven: a different group secret" in str(e) for e in errors), errors


def test_the_wake_up_port_is_taken_only_by_the_rank_that_proves_itself(tmp_path):
    """Rank 0's wake-up port: a local process, a stranger with the wrong secret and a connection held open all
    come first; the real worker still takes its place, and the stranger none."""
    specs = loopback_specs(tmp_path, 2)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got: dict = {}
    leader = threading.Thread(target=lambda: got.update(peers=accept_followers(server, specs[0],
                                                                              time.monotonic() + 30)))
    leader.start()
    stranger = dataclasses.replace(specs[1], key=GroupKey(bytes(32), specs[1].hosts))
    held = socket.create_connection(("127.0.0.1", port))  # says nothing
    with pytest.raises(GroupLost, match="could not prove itself"):
        dial_leader(stranger, "127.0.0.1", port, 5)
    squatter = socket.create_connection(("127.0.0.1", port))
    squatter.sendall(b"provider-group/2 1 " + b"a" * 32 + b" " + b"b" * 64 + b"\n")
    worker = dial_leader(specs[1], "127.0.0.1", port, 10)
    leader.join(30)
    server.close()
    assert len(got["peers"]) == 1
    Doorbell(got["peers"]).ring()
    Doorbell([worker]).wait()  # the worker's connection is the one rank 0 rings
    assert squatter.recv(200).startswith(b"provider-group/2 challenge")
    for conn in (held, squatter, worker, *got["peers"]):
        conn.close()


def test_a_rank_that_stops_reading_its_wake_ups_is_lost_not_waited_for():
    """`sendall` had no timeout: a worker that stops reading blocked rank 0 for ever."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.settimeout(0.5)  # as open_doorbell sets it (group_step_timeout_s)
    bell = Doorbell([a])
    with pytest.raises(GroupLost, match="gone"):
        for _ in range(10_000_000):
            bell.ring()
    a.close()
    b.close()


def test_public_addresses_are_found_and_private_ones_pass():
    hosts = (("192.168.1.2:1",), ("10.0.0.2:1",), ("127.0.0.1:1",), ("169.254.0.2:1",), ("100.100.1.1:1",),
             ("[fd00::1]:1",), ("8.8.8.8:1",), ("[2001:4860::1]:1",))
    assert public_addresses(hosts) == ["8.8.8.8:1", "[2001:4860::1]:1"]


def test_start_refuses_a_group_over_public_addresses_without_the_flag(tmp_path):
    import sys

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["8.8.8.8:5000"], ["127.0.0.1:5001"]]))
    env = {"PROVIDER_GROUP_SECRET_FILE": str(write_secret(tmp_path / "secret")), "XDG_STATE_HOME": str(tmp_path),
           "XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # tests/conftest.py: children run without torch
    run = subprocess.run([sys.executable, "-m", "provider", "start", "--group", str(hostfile), "--rank", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "public addresses (8.8.8.8:5000)" in run.stderr, run.stderr
    assert "--group-public-network" in run.stderr
