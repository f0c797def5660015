"""The simulator reproduces the papers' qualitative results (ElasWave §7.2, Chameleon §V-B).

Measured values (see the README, "Results beside the papers") are printed with `pytest -s`. Each
steady-state number is also replayed through the discrete-event engine (`run_policy`: healthy,
then the node loss, then each policy's recovery and steady segment) and must equal the engine's
steady segment, so the reported table is the simulator's output. Tolerance bands:
- ElasWave / TorchFT on Llama2-34B, one node lost: paper 1.6x; band [1.2, 2.0] (+-25 %). With
  TorchFT keeping 2 of 3 replicas, any plan that scales at most linearly is bounded by
  (88/96)/(2/3) = 1.375 (x 1650/1400 with every stage up-clocked), so the paper's 1.6x cannot
  be reached by an ideal model; we measure ~1.33.
- ElasWave / ReCycle, same case: paper 1.35x; band [1.01, 1.69] (+-25 %); we measure ~1.31.
"""

from __future__ import annotations

import pytest

from planners.chameleon.policy import POLICIES
from planners.chameleon.state import ClusterState, MttrModel
from simulator.engine import PolicyRun, base_mttr, dead_device_timeline, run_policy
from simulator.jobs import JOBS, ranks_of_devices
from simulator.traces import poisson_device_failures

TABLE2 = ("llama2-7b", "llama2-13b", "llama2-34b")
REPLAY_POLICIES = ("elaswave", "elaswave-migrate", "elaswave-resize", "recycle", "torchft")
LOSS_AT_S, HORIZON_S = 600.0, 7200.0


def after_node_loss(job: str, nodes: int) -> dict[str, float]:
    """Steady throughput of each policy after losing the first `nodes` nodes (8 devices each)."""
    spec = JOBS[job]
    shape, prof = spec.shape, spec.profile()
    failed = ranks_of_devices(spec, set(range(nodes * spec.devices_per_node)))
    state = ClusterState(shape, prof, failed=failed)
    out = {p: POLICIES[p](state).throughput for p in REPLAY_POLICIES}
    out["fault_free"] = POLICIES["torchft"](ClusterState(shape, prof)).throughput
    out["alive_fraction"] = 1 - nodes * spec.devices_per_node / shape.num_devices
    return out


def replay_node_loss(job: str, nodes: int) -> dict[str, PolicyRun]:
    """The same event through the simulator engine: healthy until `LOSS_AT_S`, then the first
    `nodes` nodes are gone for the rest of `HORIZON_S`; one `run_policy` replay per policy."""
    spec = JOBS[job]
    timeline = [(0.0, frozenset()), (LOSS_AT_S, frozenset(range(nodes * spec.devices_per_node)))]
    return {p: run_policy(p, spec, timeline, HORIZON_S, expected_gap_s=3600.0) for p in REPLAY_POLICIES}


def whole_replicas_lost(job: str, nodes: int) -> bool:
    spec = JOBS[job]
    return (nodes * spec.devices_per_node) % (spec.shape.pp * spec.shape.tp) == 0


@pytest.mark.parametrize("job", TABLE2)
@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_throughput_orders_elaswave_recycle_torchft(job: str, nodes: int) -> None:
    r = after_node_loss(job, nodes)
    lse = r["elaswave"] / (r["fault_free"] * r["alive_fraction"])
    print(
        f"{job} -{nodes} node(s): "
        + ", ".join(
            f"{k}={v / r['fault_free']:.3f}"
            for k, v in r.items()
            if k not in ("fault_free", "alive_fraction")
        )
        + f", LSE={lse:.3f}"
    )
    assert lse >= 0.89
    if whole_replicas_lost(job, nodes):
        # ElasWave §7.2: losing whole replicas degenerates ElasWave and ReCycle to TorchFT.
        assert r["recycle"] == pytest.approx(r["torchft"], rel=0.01)
        assert r["elaswave-migrate"] == pytest.approx(r["torchft"], rel=0.01)
        assert r["elaswave"] >= r["torchft"] * 0.99
    else:
        assert r["elaswave"] > r["recycle"] > r["torchft"]


@pytest.mark.parametrize("job", TABLE2)
@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_replay_through_the_engine_gives_the_reported_numbers(job: str, nodes: int) -> None:
    """Each reported steady number is what the discrete-event engine runs at after the loss: the
    replay's last segment has exactly the candidate's throughput and LSE, its recovery lasts the
    policy's MTTR, and the time average over the replay is the hand-computed mix of the two."""
    steady = after_node_loss(job, nodes)
    runs = replay_node_loss(job, nodes)
    spec = JOBS[job]
    alive = 1 - nodes * spec.devices_per_node / spec.shape.num_devices
    mttr = MttrModel()
    for policy, run in runs.items():
        healthy, *rest = run.segments
        assert run.fault_free_throughput == pytest.approx(steady["fault_free"], rel=1e-12)
        assert (healthy.start_s, healthy.end_s) == (0.0, LOSS_AT_S)
        assert healthy.throughput == pytest.approx(steady["fault_free"], rel=1e-12)
        after = rest[-1]
        if steady[policy] == 0.0:  # no feasible plan (34B resize alone is OOM): the job stalls
            assert after.throughput == 0.0 and after.end_s == HORIZON_S and after.lse is None
            continue
        assert after.throughput == pytest.approx(steady[policy], rel=1e-12), policy
        assert after.lse == pytest.approx(after.throughput / (steady["fault_free"] * alive), rel=1e-12)
        recovery = sum(seg.end_s - seg.start_s for seg in rest if seg.throughput == 0.0)
        assert recovery >= base_mttr(policy, mttr) - 1e-9, policy
        assert run.time_averaged_throughput == pytest.approx(
            (LOSS_AT_S * healthy.throughput + (HORIZON_S - LOSS_AT_S - recovery) * after.throughput)
            / HORIZON_S
        )
    replayed = {p: runs[p].segments[-1].throughput for p in runs}
    if whole_replicas_lost(job, nodes):
        assert replayed["recycle"] == pytest.approx(replayed["torchft"], rel=0.01)
        assert replayed["elaswave"] >= replayed["torchft"] * 0.99
    else:
        assert replayed["elaswave"] > replayed["recycle"] > replayed["torchft"]


def test_whole_replica_cases_are_the_papers() -> None:
    assert whole_replicas_lost("llama2-7b", 3) and whole_replicas_lost("llama2-13b", 3)
    assert not any(whole_replicas_lost(j, n) for j in TABLE2 for n in (1, 2)) and not whole_replicas_lost(
        "llama2-34b", 3
    )


def test_llama2_34b_one_node_ratios_within_band() -> None:
    r = after_node_loss("llama2-34b", 1)
    vs_torchft, vs_recycle = r["elaswave"] / r["torchft"], r["elaswave"] / r["recycle"]
    # The same ratios from the engine's replay: steady segment after the loss, and time-averaged
    # over two hours that include the loss and each policy's recovery.
    runs = replay_node_loss("llama2-34b", 1)
    steady = {p: run.segments[-1].throughput for p, run in runs.items()}
    averaged = {p: run.time_averaged_throughput for p, run in runs.items()}
    print(
        f"llama2-34b -1 node: ElasWave/TorchFT = {vs_torchft:.3f} (paper 1.6), "
        f"ElasWave/ReCycle = {vs_recycle:.3f} (paper 1.35); replayed steady "
        f"{steady['elaswave'] / steady['torchft']:.3f} / {steady['elaswave'] / steady['recycle']:.3f}, "
        f"time-averaged over {HORIZON_S / 3600:.0f} h {averaged['elaswave'] / averaged['torchft']:.3f} / "
        f"{averaged['elaswave'] / averaged['recycle']:.3f}"
    )
    assert steady["elaswave"] / steady["torchft"] == pytest.approx(vs_torchft, rel=1e-12)
    assert steady["elaswave"] / steady["recycle"] == pytest.approx(vs_recycle, rel=1e-12)
    # Linear scaling caps the ratio: TorchFT keeps 2 of 3 replicas, ElasWave 88 of 96 devices.
    assert vs_torchft <= (88 / 96) / (2 / 3) * 1.0001
    # The paper's figures (1.60 and 1.35) with a +-25 % band; measured 1.33 and 1.31, and the bound
    # above shows why 1.6 itself is out of reach for a plan at most linear in devices.
    assert 1.2 <= vs_torchft <= 2.0
    assert 1.01 <= vs_recycle <= 1.69


def test_chameleon_ranks_above_recycle_in_chameleons_setting() -> None:
    # Chameleon §V-B: 32 NPUs, 10 % failures per NPU-hour, 9 hours; failed NPUs stay out (Fig. 7).
    spec, hours = JOBS["chameleon-7b"], 9.0
    gap = 3600 / (0.1 * spec.shape.num_devices)
    ratios = []
    for seed in range(4):
        timeline = dead_device_timeline(
            poisson_device_failures(32, 0.1, hours, seed, repair_hours=None), spec
        )
        cham = run_policy("chameleon", spec, timeline, hours * 3600, gap).time_averaged_throughput
        rec = run_policy("recycle", spec, timeline, hours * 3600, gap).time_averaged_throughput
        ratios.append(cham / rec)
    print(
        f"Chameleon / ReCycle time-averaged throughput per seed: {[round(x, 3) for x in ratios]} (paper 1.355)"
    )
    assert all(x > 1.0 for x in ratios)
    assert sum(ratios) / len(ratios) > 1.05
