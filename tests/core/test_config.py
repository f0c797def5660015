"""Core settings: environment, TOML file, validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from core_service.config import ConfigError, load_settings


def test_environment_and_toml_file_with_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "core.toml"
    config.write_text(
        'scheduler_token = "file-token-0123456789"\nheartbeat_timeout_s = 4.5\n'
        '[[jobs]]\nname = "llama"\ntoken = "job-token-0123456789"\nexpected_workers = 8\n'
        "[failslow]\nratio = 1.3\n"
    )
    monkeypatch.setenv("ELASWAVE_CONFIG", str(config))
    monkeypatch.setenv("ELASWAVE_HEARTBEAT_TIMEOUT_S", "1.5")
    settings = load_settings(grpc_port=0)
    assert settings.heartbeat_timeout_s == 1.5  # environment beats the file
    assert settings.scheduler_token is not None
    assert settings.scheduler_token.get_secret_value() == "file-token-0123456789"
    assert settings.jobs[0].name == "llama" and settings.jobs[0].expected_workers == 8
    assert settings.failslow.ratio == 1.3 and settings.grpc_port == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "scheduler_token is required"),
        ({"scheduler_token": "short"}, "scheduler_token is shorter than 16"),
        (
            {"scheduler_token": "x" * 20, "grpc_port": 70000},
            "grpc_port: Input should be less than or equal to 65535",
        ),
        ({"scheduler_token": "x" * 20, "registry_url": "redis://x"}, "neither 'memory://' nor 'etcd://"),
        ({"scheduler_token": "x" * 20, "heartbeat_timeout_s": 0}, "heartbeat_timeout_s"),
        (
            {"scheduler_token": "x" * 20, "tls_cert": "/nonexistent.pem"},
            "tls_cert and tls_key must be given together",
        ),
        (
            {"scheduler_token": "x" * 20, "jobs": [{"name": "bad name", "token": "y" * 20}]},
            "job name 'bad name'",
        ),
    ],
)
def test_invalid_settings_name_the_field(
    overrides: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASWAVE_SCHEDULER_TOKEN", raising=False)
    monkeypatch.delenv("ELASWAVE_CONFIG", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(**overrides)
    assert message in str(err.value)


def test_dev_mode_runs_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASWAVE_SCHEDULER_TOKEN", raising=False)
    assert load_settings(dev_mode=True).scheduler_token is None


def test_lease_shorter_than_the_heartbeat_timeout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASWAVE_CONFIG", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(scheduler_token="x" * 20, heartbeat_timeout_s=10, lease_ttl_s=5)
    assert "lease_ttl_s (5.0) must be >= heartbeat_timeout_s (10.0)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_settings(scheduler_token="x" * 20, metrics_persist_interval_s=5)
    assert "metrics_persist_interval_s: Extra inputs are not permitted" in str(err.value)


def test_heartbeat_ceiling_defaults_above_the_floor_and_below_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ELASWAVE_CONFIG", raising=False)
    assert load_settings(scheduler_token="x" * 20).heartbeat_ceiling == 30.0
    long_floor = load_settings(scheduler_token="x" * 20, heartbeat_timeout_s=600, lease_ttl_s=600)
    assert long_floor.heartbeat_ceiling_s == long_floor.heartbeat_ceiling == 600.0
    with pytest.raises(ConfigError) as err:
        load_settings(scheduler_token="x" * 20, heartbeat_timeout_s=3, heartbeat_ceiling_s=2)
    assert "heartbeat_ceiling_s (2.0) must be >= heartbeat_timeout_s (3.0)" in str(err.value)


def _config_error(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    monkeypatch.delenv("ELASWAVE_CONFIG", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings(scheduler_token="x" * 20)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unparseable_sources_name_the_file_or_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "core.toml"
    broken.write_text('scheduler_token = "file-token-0123456789"\nheartbeat_timeout_s = \n')
    assert _config_error(monkeypatch, ELASWAVE_CONFIG=str(broken)) == (
        f"config file {str(broken)!r} is not valid TOML: Invalid value (at line 2, column 23)"
    )
    missing = tmp_path / "nope.toml"
    assert _config_error(monkeypatch, ELASWAVE_CONFIG=str(missing)) == (
        f"config file {str(missing)!r} (--config / ELASWAVE_CONFIG) does not exist or is not a file"
    )
    assert _config_error(monkeypatch, ELASWAVE_CONFIG=str(tmp_path)).endswith(
        "does not exist or is not a file"
    )
    monkeypatch.delenv("ELASWAVE_CONFIG")
    assert _config_error(monkeypatch, ELASWAVE_JOBS="notjson") == (
        "environment variable ELASWAVE_JOBS (setting jobs) is not JSON: Expecting value: line 1 column 1 (char 0)"
    )
    monkeypatch.delenv("ELASWAVE_JOBS")
    assert _config_error(monkeypatch, ELASWAVE_FAILSLOW='{"ratio": ').startswith(
        "environment variable ELASWAVE_FAILSLOW (setting failslow) is not JSON: Expecting value"
    )


@pytest.mark.timeout(60)
def test_cli_exits_2_with_one_line_for_every_config_mistake(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    broken = tmp_path / "broken.toml"
    broken.write_text("[[jobs]\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_")}
    base["ELASWAVE_SCHEDULER_TOKEN"] = "x" * 20
    cases = [
        (["--config", str(tmp_path / "missing.toml")], {}, "does not exist or is not a file"),
        (["--config", str(broken)], {}, f"config file {str(broken)!r} is not valid TOML"),
        ([], {"ELASWAVE_JOBS": "notjson"}, "environment variable ELASWAVE_JOBS (setting jobs) is not JSON"),
    ]
    for args, env, text in cases:
        result = subprocess.run(
            [sys.executable, "-m", "elaswave.cli", "core", "--grpc-port", "0", "--http-port", "0", *args],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2, (args, env, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elaswave core: ") and text in lines[0], result.stderr
