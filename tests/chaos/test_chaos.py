"""The bounded chaos suite (issue: survive what clusters do): real Core, store, agents and GPT
workers; each scenario's faults fire at chosen steps, and the job must finish with no process
restarted, every step committed, every sample once per stage, the loss on the fault-free curve
and the final parameters and Adam moments equal to the fault-free run's up to fp32 round-off.
The MTTR of every fault is printed (`pytest -s`); `make chaos` runs the long seeded version."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.chaos import ChaosScenario, run_scenario
from tests.chaos.scenarios import SCENARIOS

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "scenario",
    [pytest.param(s, marks=[pytest.mark.etcd] if s.cores > 1 else []) for s in SCENARIOS],
    ids=lambda s: s.name,
)
def test_job_survives_the_schedule_and_matches_the_fault_free_run(
    scenario: ChaosScenario, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Two Cores keep their state in a real etcd (the session's, emptied for this test).
    registry = request.getfixturevalue("etcd_registry_url") if scenario.cores > 1 else None
    outcome = run_scenario(scenario, tmp_path, timeout_s=240.0, registry=registry)
    print(outcome.summary())
    assert outcome.problems == [], outcome.summary() + "\n" + "\n".join(outcome.problems)
    assert all(r.mttr_s is not None for r in outcome.faults)
    # Every fault here leaves a copy of each lost shard (a whole stage's in its neighbour), so
    # everything recovers from memory: no checkpoint read, no committed step lost. (A stage lost
    # with its backups restores from the checkpoint: tests/test_launcher.py, bench.mttr.)
    assert all(m == "in_place" for r in outcome.faults for m in r.modes), outcome.summary()
    assert all(r.steps_lost == 0 for r in outcome.faults), outcome.summary()
    for record in outcome.faults:
        # the itemisation covers the MTTR exactly, and the plan reached every survivor after
        # its publication (`harness.chaos.itemise`); a Core failover has no plan to itemise
        if record.epochs:
            assert record.mttr_s is not None
            assert abs(sum(record.phases.values()) - record.mttr_s) < 1e-9, record.phases
            assert record.phases.get("deliver", -1.0) >= 0.0, record.phases
