"""Every request an attacker sent that took a node down, replayed against a live node: each ends in a 4xx or a
typed error, and a good request succeeds right after it (llama-tiny: vocabulary 512, context 1024)."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import zlib

import httpx
import psutil
import pytest

from tests.helpers import LocalServer

GOOD = {"model": "llama-tiny", "prompt": "The cache", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(fixtures_dir, tmp_path_factory):
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path_factory.mktemp("hostile"))
    yield srv
    assert srv.stop() == 0


def _post(server, body, *, headers=None, path=None, raw=False):
    content = body if raw else json.dumps(body).encode()
    path = path or ("/v1/chat/completions" if b'"messages"' in content else "/v1/completions")
    h = {"Content-Type": "application/json", **server.headers, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def _still_serving(server, sampled=False):
    body = GOOD | ({"temperature": 1.0} if sampled else {})
    r = _post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


BIG = int("9" * 400)

CASES = [
    # 1. out-of-vocabulary logit_bias ids crashed the process (SIGSEGV, SIGABRT)
    ("logit_bias 2**31", GOOD | {"logit_bias": {"2147483648": 1}}, 400, "vocabulary of 512"),
    ("logit_bias = vocab", GOOD | {"logit_bias": {"512": 1}}, 400, "vocabulary of 512"),
    ("logit_bias 600", GOOD | {"logit_bias": {"600": 5}}, 400, "vocabulary of 512"),
    ("stop_token_ids past vocab", GOOD | {"stop_token_ids": [100000]}, 400, "vocabulary of 512"),
    # 2. the engine thread died silently
    ("logit_bias 2**70", GOOD | {"logit_bias": {"1180591620717411303424": 1}}, 400, "vocabulary of 512"),
    ("logit_bias value huge", GOOD | {"logit_bias": {"5": BIG}}, 400, "logit_bias"),
    # 4. 500 where a 400 belongs: a 400-digit integer in any numeric field
    *[(f"400-digit {k}", GOOD | {k: BIG}, 400, k) for k in
      ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
       "repetition_penalty")],
    ("-400-digit temperature", GOOD | {"temperature": -BIG}, 400, "temperature"),
    ("role list", {"model": "llama-tiny", "messages": [{"role": ["user"], "content": "x"}], "max_tokens": 2}, 400,
     "role"),
    ("role dict", {"model": "llama-tiny", "messages": [{"role": {"a": 1}, "content": "x"}], "max_tokens": 2}, 400,
     "role"),
    ("logit_bias key not decimal", GOOD | {"logit_bias": {"1e5": 1}}, 400, "logit_bias"),
    ("logit_bias key of 4,301 digits", GOOD | {"logit_bias": {"1" * 4301: 1}}, 400, "logit_bias"),  # int(): a 500
    ("bool temperature", GOOD | {"temperature": True}, 400, "temperature"),
    ("stop list of ints", GOOD | {"stop": [1]}, 400, "stop"),
    ("stop string too long", GOOD | {"stop": "x" * 5000}, 400, "stop"),
]


@pytest.mark.parametrize("name, body, status, fragment", CASES, ids=[c[0] for c in CASES])
def test_hostile_fields_are_4xx_and_the_node_keeps_serving(server, name, body, status, fragment):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] or fragment == err["param"], err
    _still_serving(server)


@pytest.mark.parametrize("name, raw, headers, status", [
    ("lone surrogate in prompt", b'{"prompt": "hi \\ud800", "max_tokens": 2}', {}, 400),
    ("lone surrogate in chat", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', {}, 400),
    ("nested 1000 deep", b'{"prompt": "x", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}", {}, 400),
    ("nested 100000 deep", b"[" * 100000 + b"]" * 100000, {}, 400),
    ("bogus charset", json.dumps(GOOD).encode(), {"Content-Type": "application/json; charset=bogus"}, 415),
    ("latin-1 bytes", b'{"prompt": "caf\xe9"}', {}, 400),
    ("gzip garbage", b"this is not gzip at all", {"Content-Encoding": "gzip"}, 400),
    ("deflate garbage", b"\x00\x01\x02", {"Content-Encoding": "deflate"}, 400),
    ("deflate bytes", b"garbage!", {"Content-Encoding": "deflate"}, 400),
    ("brotli", b"xx", {"Content-Encoding": "br"}, 415),
    ("gzip bomb", gzip.compress(b'{"prompt": "' + b" " * (32 * 2**20) + b'"}'), {"Content-Encoding": "gzip"}, 413),
    ("NaN", b'{"prompt": "x", "temperature": NaN}', {}, 400),
    ("1e400 is infinite", b'{"prompt": "x", "temperature": 1e400}', {}, 400),
    ("not JSON", b"\xff\xfe\x00garbage", {}, 400),
])
def test_hostile_bodies_are_4xx_and_the_node_keeps_serving(server, name, raw, headers, status):
    r = _post(server, raw, headers=headers, raw=True)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    _still_serving(server)


@pytest.mark.parametrize("encoding, compress", [
    ("gzip", gzip.compress), ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b, wbits=-zlib.MAX_WBITS))])  # raw deflate, as some clients send
def test_compressed_bodies_are_served(server, encoding, compress):
    r = _post(server, compress(json.dumps(GOOD).encode()), headers={"Content-Encoding": encoding}, raw=True)
    assert r.status_code == 200, r.text


def test_non_utf8_authorization_header_is_401(server):
    with httpx.Client() as c:
        r = c.post(server.url + "/v1/completions", content=json.dumps(GOOD).encode(),
                   headers=[(b"Authorization", b"Bearer \xff\xfe\x80"), (b"Content-Type", b"application/json")])
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    _still_serving(server)


def test_top_k_at_or_above_the_vocabulary_is_clamped_and_sampling_stays_healthy(server):
    for top_k in (511, 512, 100000, 2**32 - 1):
        r = _post(server, GOOD | {"top_k": top_k, "temperature": 1.0})
        assert r.status_code == 200, (top_k, r.text)
    for _ in range(3):  # unseeded sampled requests after it: mlx-lm's random state must not be left broken
        _still_serving(server, sampled=True)


def test_a_multi_megabyte_prompt_is_refused_without_tokenizing_it(server):
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss  # the server's own process: nothing else runs there now
    r = _post(server, {"prompt": "word " * 700_000, "max_tokens": 2})  # 3.5 MB, under the 4 MiB body limit
    assert r.status_code == 400 and "context of 1024" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # Refused on its length in characters, before any tokenizing (which took 7.6 s and 450 MiB before).
    assert "1024 tokens can hold" in r.json()["error"]["message"], r.text
    assert (proc.memory_info().rss - rss_before) < 200 * 2**20
    _still_serving(server)


def _start(args, home, timeout=120):
    env = os.environ | {"XDG_STATE_HOME": str(home / "state"), "XDG_CONFIG_HOME": str(home / "config"),
                        "XDG_CACHE_HOME": str(home / "cache"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "provider", "start", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_public_bind_without_auth_is_refused_before_anything_loads(fixtures_dir, tmp_path):
    out = _start(["--local", "--bind", "0.0.0.0", "--no-auth", "--model", str(fixtures_dir / "llama-tiny")],
                 tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allow-unauthenticated-public" in lines[0], out.stderr
    assert "serving" not in out.stdout


def test_public_bind_without_auth_runs_when_allowed_with_a_warning(fixtures_dir, tmp_path):
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path, "--no-auth", "--bind", "0.0.0.0",
                      "--allow-unauthenticated-public")
    try:
        url = srv.url.replace("0.0.0.0", "127.0.0.1")
        assert httpx.post(url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
    finally:
        assert srv.stop() == 0
    assert "WARNING: serving without auth on 0.0.0.0" in srv.logs()


def _broken_store(fixtures_dir, root):
    models = root / "models"
    for name, config in [("array-config", "[]"), ("garbage-config", "{ not json"),
                         ("list-text-config", '{"model_type": "llama", "text_config": [1]}')]:
        shutil.copytree(fixtures_dir / "llama-tiny", models / name)
        (models / name / "config.json").write_text(config)
    shutil.copytree(fixtures_dir / "qwen3-tiny", models / "qwen3-tiny")
    return models


def test_broken_model_directories_are_isolated(fixtures_dir, tmp_path):
    models = _broken_store(fixtures_dir, tmp_path)
    env = {"PROVIDER_MODELS_DIR": str(models)}
    srv = LocalServer(None, tmp_path, env=env)  # the bundled default plus a store with three broken models
    try:
        h = srv.headers
        ids = [m["id"] for m in httpx.get(srv.url + "/v1/models", headers=h).json()["data"]]
        assert "qwen3-tiny" in ids and "array-config" in ids
        r = httpx.post(srv.url + "/v1/completions", headers=h, timeout=60,
                       json={"model": "array-config", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and "not a JSON object" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "model_load_failed"
        r = httpx.post(srv.url + "/v1/completions", headers=h, timeout=60,
                       json={"model": "qwen3-tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0
    run_env = os.environ | env | {"XDG_STATE_HOME": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1"}
    listing = subprocess.run([sys.executable, "-m", "provider", "models", "list"], capture_output=True, text=True,
                             env=run_env, timeout=120)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert "not a JSON object" in rows["array-config"] and "unreadable" in rows["garbage-config"]
    assert "unreadable" in rows["list-text-config"] or "llama" in rows["list-text-config"]
    doctor = subprocess.run([sys.executable, "-m", "provider", "doctor"], capture_output=True, text=True,
                            env=run_env, timeout=120)
    assert "array-config" in doctor.stdout and "not a JSON object" in doctor.stdout, doctor.stdout


def test_an_explicit_model_with_a_broken_config_is_a_one_line_error(fixtures_dir, tmp_path):
    models = _broken_store(fixtures_dir, tmp_path)
    out = _start(["--local", "--port", "0", "--model", str(models / "array-config")], tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines and "not a JSON object" in lines[-1] and "Traceback" not in out.stderr, out.stderr


def test_grpc_big_prompt_and_top_k_are_typed_and_nobody_stalls(fixtures_dir, tmp_path):
    from coordinator_client.pb import provider_pb2 as pb
    from tools.harness.nodes import harness, job
    from tests.helpers import run

    async def main():
        async with harness({"l": fixtures_dir / "llama-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("warm", "l", max_tokens=2))
            await coord.outcome("warm")
            coord.dispatch(s, job("stream", "l", max_tokens=200))
            coord.dispatch(s, job("huge", "l", prompt="word " * 600_000))  # 3 MB, under gRPC's 4 MiB
            err = (await coord.outcome("huge")).job_error
            assert err.cause == pb.ERROR_CAUSE_CONTEXT_LENGTH_EXCEEDED and "context of 1024" in err.message
            assert "1024 tokens can hold" in err.message  # refused on its characters, not tokenized (10-15 s)
            big_k = job("top-k", "l", max_tokens=3, temperature=1.0)
            big_k.sampling.top_k = 2**32 - 1
            coord.dispatch(s, big_k)
            assert (await coord.outcome("top-k")).WhichOneof("frame") == "job_done"
            assert (await coord.outcome("stream")).WhichOneof("frame") == "job_done"
            assert session.stats.sessions == 1

    run(main())


def test_hostile_schemas_and_tool_lists_get_a_4xx_naming_their_field_or_are_served(server):
    """Every schema built to hurt a grammar compiler (tools/harness/hostile.py), as a response_format and as a
    tool's parameters: refused with 400 naming the field, or served within its bounds (a recursion that can
    never close ends with a typed 400 when its grammar stops); never a 5xx, and the node serves after each."""
    from tools.harness.hostile import HOSTILE_SCHEMAS

    chat = {"model": "llama-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "temperature": 1.0}
    for i, schema in enumerate(HOSTILE_SCHEMAS):
        bodies = [(chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}},
                   "response_format"),
                  (chat | {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                           "tool_choice": "required"}, "tools")]
        for body, param in bodies:
            r = _post(server, body, path="/v1/chat/completions")
            assert r.status_code in (200, 400), (i, param, r.status_code, r.text[:300])
            if r.status_code == 400:  # messages: the tools written into the prompt make it longer than the context
                assert r.json()["error"]["param"] in (param, "tool_choice", "messages"), (i, r.text[:300])
    many = chat | {"tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)]}
    assert _post(server, many).json()["error"]["param"] == "tools"
    _still_serving(server)
