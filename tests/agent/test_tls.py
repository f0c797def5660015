"""mTLS between agent and Core: certificates made by openssl for this test, a real TLS server."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from tests.agent.harness import RecordingCore, base_args, sleeper_command

pytestmark = pytest.mark.multiproc

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _issue(name: str, ca_dir: Path, san: str | None = None) -> None:
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=ca_dir)
    extra: list[str] = []
    if san:
        (ca_dir / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        *extra,
        cwd=ca_dir,
    )


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    ca_dir = tmp_path / "pki"
    ca_dir.mkdir()
    _openssl(
        "req",
        "-x509",
        *_EC,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=ca_dir,
    )
    _issue("core", ca_dir, san="IP:127.0.0.1")
    _issue("agent-w0", ca_dir)
    return ca_dir


@pytest.mark.timeout(40)
def test_mutual_tls_registration(run_agent, tmp_path: Path, pki: Path):
    credentials = grpc.ssl_server_credentials(
        [((pki / "core.key").read_bytes(), (pki / "core.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    core = RecordingCore(tls=credentials).start()
    try:
        plain = run_agent(base_args(tmp_path, core.address, "plain") + sleeper_command(tmp_path))
        agent = run_agent(
            base_args(
                tmp_path,
                core.address,
                "w0",
                "--tls-ca",
                str(pki / "ca.pem"),
                "--tls-cert",
                str(pki / "agent-w0.pem"),
                "--tls-key",
                str(pki / "agent-w0.key"),
            )
            + sleeper_command(tmp_path)
        )
        registers = core.wait_kind("register", timeout=15)
        assert [r.request.register.worker_id for r in registers] == ["w0"]  # plaintext never gets in
        assert core.streams[0].auth["x509_common_name"] == [b"agent-w0"]
        core.wait_kind("heartbeat")
        plain.wait_log("core_stream_failed")  # its handshake is refused, and it keeps trying
        assert plain.proc.poll() is None and len(core.of_kind("register")) == 1
        assert agent.proc.poll() is None
    finally:
        core.close()
