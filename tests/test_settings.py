import dataclasses

import pytest

from provider.settings import Settings, SettingsError


def test_layers_file_then_env_then_cli(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('port = 9000\nbind = "0.0.0.0"\nmax_concurrent_jobs = 3\n')
    s = Settings.load(cli={"port": 9002, "bind": None}, env={"PROVIDER_PORT": "9001", "PROVIDER_AUTH": "false"},
                      config_file=cfg)
    assert s.port == 9002  # CLI beats env beats file
    assert s.bind == "0.0.0.0"  # CLI None means "not given"
    assert s.auth is False
    assert s.max_concurrent_jobs == 3


def test_env_overrides_file(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("port = 9000\n")
    assert Settings.load(env={"PROVIDER_PORT": "9001"}, config_file=cfg).port == 9001


def test_config_file_from_xdg_dir(tmp_path, monkeypatch):
    path = tmp_path / "xdg_config_home" / "provider" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text('log_level = "debug"\n')
    assert Settings.load(env={}).log_level == "debug"


@pytest.mark.parametrize(
    "source, expected",
    [
        ({"env": {"PROVIDER_PORT": "70000"}}, r"port \(from PROVIDER_PORT\) is 70000; allowed range is 0 to 65535"),
        ({"env": {"PROVIDER_PORT": "eighty"}}, r"port \(from PROVIDER_PORT\): expected int"),
        ({"cli": {"memory_fraction": 1.5}}, r"memory_fraction \(from --memory-fraction\) is 1.5; allowed range"),
        # NaN compares false both ways: it was taken (a NaN stall time ended a session at once)
        ({"env": {"PROVIDER_COORDINATOR_OUTBOX_STALL_S": "nan"}},
         r"coordinator_outbox_stall_s \(from PROVIDER_COORDINATOR_OUTBOX_STALL_S\) is nan; allowed range"),
        ({"cli": {"memory_fraction": float("nan")}}, r"memory_fraction \(from --memory-fraction\) is nan; allowed"),
        ({"env": {"PROVIDER_LOG_LEVEL": "loud"}}, r"log_level .* allowed: debug, info, warning, error"),
        ({"env": {"PROVIDER_AUTH": "maybe"}}, r"auth \(from PROVIDER_AUTH\): expected bool"),
        ({"cli": {"default_max_tokens": 99999}}, r"default_max_tokens \(99999\) must not exceed max_tokens_limit"),
    ],
)
def test_bad_values_name_the_key_and_range(source, expected):
    with pytest.raises(SettingsError, match=expected):
        Settings.load(config_file=None, **({"env": {}} | source))


def test_bad_file_key_and_syntax(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("prot = 1\n")
    with pytest.raises(SettingsError, match="unknown key 'prot'"):
        Settings.load(env={}, config_file=cfg)
    cfg.write_text("port = \n")
    with pytest.raises(SettingsError, match="cannot read config file"):
        Settings.load(env={}, config_file=cfg)
    cfg.write_text("port = 80.5\n")
    with pytest.raises(SettingsError, match="port .*expected int"):
        Settings.load(env={}, config_file=cfg)


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1


def test_cli_start_reports_bad_setting(tmp_path):
    import subprocess, sys
    r = subprocess.run([sys.executable, "-m", "provider", "start", "--local", "--port", "99999"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "port (from --port) is 99999; allowed range is 0 to 65535" in r.stderr
