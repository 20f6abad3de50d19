"""`provider generate` through the real CLI in a subprocess: greedy text as mlx-lm's, the bundled pair's
speculation lossless and reported, stdin, --json, --json-schema, one-line errors with their codes, Ctrl-C.
Beside a running daemon (the job goes to it): tests/test_generate_daemon.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import reference

PROMPT = "Returns the value of the attribute"


@pytest.fixture
def env(tmp_path):
    return os.environ | {"HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path / "config"),
                         "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def _generate(env, *args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "provider", "generate", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_greedy_text_is_mlx_lm_s_raw_and_through_the_chat_template(fixtures_dir, env):
    path = fixtures_dir / "llama-tiny"
    raw = _generate(env, PROMPT, "--model", str(path), "--raw", "--max-tokens", "20")
    _, tok = reference.load_cached(str(path))
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout == reference.greedy(path, tok.encode(PROMPT), 20)[1] + "\n"
    assert "20 tokens, finish length" in raw.stderr and "tok/s" in raw.stderr
    assert "in this process: 20 tokens" in raw.stderr, raw.stderr  # no daemon runs: where it ran is said
    chat = _generate(env, "--model", str(path), "--max-tokens", "12", "--system", "Be brief.", stdin=PROMPT)
    ids = reference.chat_ids(path, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}])
    assert chat.returncode == 0 and chat.stdout == reference.greedy(path, ids, 12)[1] + "\n"


def test_the_bundled_pair_speculates_losslessly_and_says_so(env):
    on = _generate(env, PROMPT, "--speculation", "on", "--max-tokens", "32", "--json")
    off = _generate(env, PROMPT, "--speculation", "off", "--max-tokens", "32", "--json")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    a, b = json.loads(on.stdout), json.loads(off.stdout)
    assert a["text"] == b["text"] and a["usage"]["completion_tokens"] == 32
    assert a["telemetry"]["speculation"]["mode"] == "mtp" and a["telemetry"]["speculation"]["accepted"] > 0
    assert b["telemetry"]["speculation"]["reason"] == "policy_off"
    streamed = _generate(env, PROMPT, "--speculation", "on", "--max-tokens", "32")
    assert streamed.stdout == a["text"] + "\n" and "speculation mtp" in streamed.stderr


def test_json_schema_answers_in_the_schema(env, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "kind": {"enum": ["capital", "town"]}},
        "required": ["name", "kind"]}))
    r = _generate(env, "Paris as JSON", "--json-schema", str(schema), "--max-tokens", "100", "--json")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop" and json.loads(out["text"])["kind"] in ("capital", "town")
    assert out["telemetry"]["constraint"] == "json_schema"


@pytest.mark.parametrize("args, code, words", [
    (["x", "--temperature", "hot"], 2, "--temperature"),
    (["x", "--temperature", "5"], 2, "--temperature"),
    (["x", "--max-tokens", "0"], 2, "--max-tokens"),
    (["x", "--speculation", "maybe"], 2, "--speculation"),
    (["x", "--image", "cat.png"], 69, "image"),
    (["x", "--json-schema", "/nonexistent.json"], 66, "--json-schema"),
    (["x", "--raw", "--system", "s"], 2, "--system"),
    (["x", "--model", "/nonexistent/model"], 66, "nonexistent"),
    ([], 66, "empty"),  # standard input with nothing in it
])
def test_errors_are_one_line_and_an_exit_code(env, args, code, words):
    r = _generate(env, *args, stdin="" if not args else None)
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("provider generate: ") and words in lines[0], r.stderr


def test_ctrl_c_cancels_and_keeps_what_was_generated(env):
    proc = subprocess.Popen([sys.executable, "-m", "provider", "generate", PROMPT, "--max-tokens", "4000",
                             "--temperature", "1.0", "--speculation", "off"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.read(20)  # text is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)  # the bound only catches a hang: "finish cancelled" says it stopped
    assert proc.returncode == 130, err
    assert len(first + out) > 20 and "finish cancelled" in err


def test_ctrl_c_also_ends_the_speculation_measurement_the_exit_would_wait_for(env, tmp_path):
    """The bundled pair's first run on a machine measures its speculation costs while it serves, and a one-shot run
    waits at exit to keep them. A Ctrl-C ends that wait too (the measurement stops at its next step, nothing kept):
    when the loop itself waited, the signal's callback ran only once the 10-20 s measurement had been written."""
    proc = subprocess.Popen([sys.executable, "-m", "provider", "generate", PROMPT, "--max-tokens", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.read(1)  # the pair serves, so its measurement is under way
    # The job's second token comes within a fraction of a second, the measurement takes 12-17 s of a core: by now
    # the process waits at exit (a Ctrl-C during the job stopped the measurement before, as it should).
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert list((tmp_path / "state" / "provider" / "speculation").glob("*.json")) == [], "the measurement was kept"
