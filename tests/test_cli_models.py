"""`provider doctor` and `provider models` as a user runs them."""

import json
import os
import shutil
import subprocess
import sys

import pytest


@pytest.fixture
def home(tmp_path, fixtures_dir):
    models = tmp_path / "cache" / "provider" / "models"
    models.mkdir(parents=True)
    for name in ("qwen3-tiny", "gemma4-tiny", "gemma4-tiny-assistant"):
        shutil.copytree(fixtures_dir / name, models / name)
    return tmp_path


def cli(home, *args, config: str | None = None):
    env = {"XDG_CACHE_HOME": str(home / "cache"), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_STATE_HOME": str(home / "state"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # tests/conftest.py: children run without torch
    if config is not None:
        (home / "config" / "provider").mkdir(parents=True, exist_ok=True)
        (home / "config" / "provider" / "config.toml").write_text(config)
    return subprocess.run([sys.executable, "-m", "provider", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_doctor_reports_budget_models_and_passes(home):
    r = cli(home, "doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "budget" in r.stdout and "psutil" in r.stdout
    assert "qwen3-tiny" in r.stdout and "gemma4-tiny" in r.stdout
    assert "mtp-capable" in r.stdout  # the assistant in the models dir pairs with gemma4-tiny
    assert "gemma4-tiny-assistant" not in r.stdout  # drafters are never servable models
    assert "ok: this node can serve" in r.stdout
    assert "ms/token" in r.stdout and "4 rows together" in r.stdout  # what speculation costs here, 1 and 4 rows


def test_doctor_fails_when_nothing_fits_or_config_is_bad(home):
    r = cli(home, "doctor", config="memory_budget_gb = 0.0001\n")
    assert r.returncode == 1 and "no model fits the memory budget" in r.stdout
    r = cli(home, "doctor", "--json", config="memory_budget_gb = 0.0001\n")  # the same report, as data
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["problems"] == ["no model fits the memory budget"], report["problems"]
    assert "qwen3-tiny" in {m["id"] for m in report["models"]} and not any(m.get("fits") for m in report["models"])
    assert report["memory"]["budget_source"] and report["speculation"] is None and report["coordinator"] is None
    r = cli(home, "doctor", config="memory_fraction = 3\n")
    assert r.returncode == 1 and "memory_fraction" in r.stdout and "allowed range" in r.stdout


def test_doctor_checks_coordinator_reachability(home):
    r = cli(home, "doctor", config='coordinator = "127.0.0.1:1"\n')
    assert r.returncode == 1 and "unreachable" in r.stdout


def test_models_list_verify_rm(home):
    r = cli(home, "models", "list")
    assert r.returncode == 0 and "qwen3-tiny" in r.stdout and "[mtp]" in r.stdout
    assert "assistant" not in r.stdout
    rows = {row["id"]: row for row in json.loads(cli(home, "models", "list", "--json").stdout)}
    assert rows["qwen3-tiny"]["origin"] and rows["qwen3-tiny"]["path"] and not any("assistant" in i for i in rows)
    r = cli(home, "models", "verify", "qwen3-tiny")
    assert r.returncode == 0
    digest = r.stdout.split("model sha256 ")[1].split()[0]
    path = home / "cache" / "provider" / "models" / "qwen3-tiny"
    pinned = f'[models.pinned]\nsource = "{path}"\nsha256 = "{"0" * 64}"\n'
    r = cli(home, "models", "verify", "pinned", config=pinned)
    assert r.returncode == 1 and "MISMATCH" in r.stderr
    r = cli(home, "models", "verify", "pinned", config=pinned.replace("0" * 64, digest))
    assert r.returncode == 0 and "matches the pinned hash" in r.stdout
    assert cli(home, "models", "rm", "qwen3-tiny").returncode == 1  # needs --yes
    assert cli(home, "models", "rm", "qwen3-tiny", "--yes").returncode == 0
    assert not path.exists()


def test_models_pull_offline_is_a_clear_error(home):
    r = cli(home, "models", "pull", "someone/not-cached")
    assert r.returncode == 1 and "not-cached" in r.stderr
