"""`LocalServices.begin` (the zygote, the stores and the Core of a one-machine `elaswave run`,
started before the model is described): when one of them cannot be spawned, whatever did start
is stopped and the directories it made for the run are removed, as `LocalServices.stop` does."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from elaswave import launcher_session
from elaswave.launcher_procs import CoreStart, LaunchError, WarmWorkers

pytestmark = pytest.mark.multiproc


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise LaunchError("cannot spawn (refused by the test)")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("refused", ["core", "zygote"])
def test_a_service_that_cannot_start_leaves_no_process_and_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sockets: list[Path] = []
    real_begin = WarmWorkers.begin

    def begin_zygote(socket_dir: Path, env: dict[str, str], log: Path) -> WarmWorkers:
        sockets.append(socket_dir)
        if refused == "zygote":
            _refuse()
        return real_begin(socket_dir, env, log)

    monkeypatch.setattr(WarmWorkers, "begin", staticmethod(begin_zygote))
    if refused == "core":
        monkeypatch.setattr(CoreStart, "begin", staticmethod(_refuse))
    run_dir = tmp_path / "runs" / "job"
    with pytest.raises(LaunchError, match="refused by the test"):
        launcher_session.LocalServices.begin(run_dir)
    assert not (tmp_path / "runs").exists(), "the directories begin made for the run are left"
    assert sockets and not sockets[0].exists(), "the zygote's socket directory is left"
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    alive = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [p.cmdline() for p in alive]
