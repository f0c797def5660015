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
    assert settings.scheduler_token.get_secret_value() == "file-token-0123456789"
    assert settings.jobs[0].name == "llama" and settings.jobs[0].expected_workers == 8
    assert settings.failslow.ratio == 1.3 and settings.grpc_port == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "scheduler_token is required"),
        ({"scheduler_token": "short"}, "scheduler_token is shorter than 16"),
        ({"scheduler_token": "x" * 20, "grpc_port": 70000}, "grpc_port: Input should be less than or equal to 65535"),
        ({"scheduler_token": "x" * 20, "registry_url": "redis://x"}, "neither 'memory://' nor 'etcd://"),
        ({"scheduler_token": "x" * 20, "heartbeat_timeout_s": 0}, "heartbeat_timeout_s"),
        ({"scheduler_token": "x" * 20, "tls_cert": "/nonexistent.pem"}, "tls_cert and tls_key must be given together"),
        ({"scheduler_token": "x" * 20, "jobs": [{"name": "bad name", "token": "y" * 20}]}, "job name 'bad name'"),
    ],
)
def test_invalid_settings_name_the_field(overrides: dict, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASWAVE_SCHEDULER_TOKEN", raising=False)
    monkeypatch.delenv("ELASWAVE_CONFIG", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(**overrides)
    assert message in str(err.value)


def test_dev_mode_runs_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASWAVE_SCHEDULER_TOKEN", raising=False)
    assert load_settings(dev_mode=True).scheduler_token is None
