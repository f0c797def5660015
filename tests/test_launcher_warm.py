"""`elaswave run` forks its workers from the node's warm zygote, and `--cold-workers` does not:
either way the job trains the same (docs/engine.md, "Warm starts")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_launcher import TINY, _job_losses, elaswave_run

pytestmark = pytest.mark.multiproc

# Before anything else: whether torch was already imported when the script began, per worker.
WARM_PROBE = """\
import os, sys
if os.environ.get("ELASWAVE_WORKER_ID"):  # a worker, not the describe run
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.environ["ELASWAVE_WORKER_ID"] + ".warm")
    with open(probe, "w") as f:
        f.write(str("torch" in sys.modules))
"""


@pytest.mark.timeout(240)
def test_workers_are_forked_warm_unless_cold_workers_and_train_the_same(tmp_path: Path) -> None:
    losses: dict[str, dict[int, float]] = {}
    for mode in ("warm", "cold"):
        where = tmp_path / mode
        where.mkdir()
        script = where / "tiny.py"
        script.write_text(WARM_PROBE + TINY)
        flags = ["--cold-workers"] if mode == "cold" else []
        run = elaswave_run(
            "--nproc-per-node", "2", "--pp", "2", *flags, script, "--steps", "4", cwd=where, timeout_s=150
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        run_dir = where / "elaswave-run" / "tiny"
        warm = {r: (where / f"rank-{r}.warm").read_text() for r in range(2)}
        assert warm == {r: str(mode == "warm") for r in range(2)}, warm
        assert (run_dir / "zygote.log").exists() == (mode == "warm")
        losses[mode] = _job_losses(run_dir, [0, 1])
        assert sorted(losses[mode]) == list(range(4))
    assert losses["warm"] == losses["cold"]  # bitwise: the same computation, only started differently
