"""`elaswave demo` as the README's first command runs it: every process real, checked end to end.

The training demo checks itself against a fault-free single-process run and exits non-zero on
any mismatch; these tests hold it to that and read the Core's view it prints.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc


def _demo(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(200)
def test_training_demo_recovers_in_place_and_matches_the_fault_free_run() -> None:
    run = _demo("--timeout", "150", timeout_s=180)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    assert "CHECK FAILED" not in out
    assert "[demo] checks passed" in out
    # The victim was lost once, through one of the two fastest paths (its agent saw the exit, or a
    # survivor's link op to it failed), and nobody else was.
    lost = re.findall(r"worker_lost\s+(rank-\d+)\s+(.*)", out)
    assert [w for w, _ in lost] == ["rank-4"], lost
    assert lost[0][1] == "worker process killed by signal 9" or lost[0][1].startswith("collective link/"), (
        lost
    )
    assert "worker_rejoined" not in out
    assert re.search(r"epoch 1 applied by 5 workers", out)
    # The ElasWave policy resized stage 1 (DP 3 -> 2) and, with the uniform block cost model,
    # moved unit 3 (block_2) off it to the adjacent stage 0 in the same plan (ElasWave §4.1-4.2).
    assert re.search(
        r"plan published \(lost ranks \[4\]; re-partition \(Algorithm 1, §4\.2\): unit 3 stage 1->0; "
        r"predicted step time \d",
        out,
    ), out[-4000:]
    assert (
        "[demo] layout now: stage 0 units 0..3 on ranks [0, 1, 2]; stage 1 units 4..5 on ranks [3, 5]" in out
    )
    members = re.search(r"members now: (\{.*\})", out)
    assert members is not None and "'rank-4': 'LOST'" in members.group(1)
    assert members.group(1).count("'LEFT'") == 5
    # One line per committed step 0..11, the replayed one marked.
    steps = re.findall(r"^\[demo\]\s+(\d+)\s+\d+\.\d+\s+\d+\.\d+\s", out, flags=re.MULTILINE)
    assert [int(s) for s in steps] == list(range(12))
    assert out.count("<- replayed on the new layout") == 1


@pytest.mark.timeout(120)
def test_control_plane_demo_sees_the_killed_worker_leave() -> None:
    run = _demo("--control-plane", "--timeout", "90", timeout_s=110)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    assert re.search(r"Core marked worker-2 LOST after \d+ ms: worker process killed by signal 9", out), out
    assert "'worker-2': 'LOST'" in out and out.count("'RUNNING'") >= 2


def test_demo_refuses_a_configuration_it_cannot_run() -> None:
    run = _demo("--dp", "1", "--victim", "1", timeout_s=60)
    assert run.returncode == 2
    assert "needs DP >= 2" in run.stderr
