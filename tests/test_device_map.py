"""Device placement (docs/accelerators.md): the launcher's mapping of every node's local ranks to
its visible devices, the refusals, and a rank that cannot see its device failing before its first
step. The mapping is a pure function, so it is tested for many nodes and device lists here; the
refusal of an unseen device runs for real on this machine's CPU-only torch (no CUDA device)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elaswave.device_map import DeviceMapError, map_devices, parse_visible, worker_device_env
from executor.devices import (
    DeviceUnavailable,
    backend_for,
    rank_device,
    resolve_kind,
)
from wire.worker_env import DEVICE_INDEX_ENV, DEVICE_SHARED_ENV, HOST_THREADS_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_each_local_rank_gets_the_device_its_visibility_list_names() -> None:
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    slots = map_devices(nodes, None, "4,5,6,7")
    assert [slots[r].index for r in range(8)] == [0, 1, 2, 3] * 2  # ordinals as the process sees them
    assert [slots[r].physical for r in range(8)] == ["4", "5", "6", "7"] * 2
    assert [slots[r].local_rank for r in range(8)] == [0, 1, 2, 3] * 2
    assert [slots[r].node for r in range(8)] == [0] * 4 + [1] * 4
    assert not any(s.shared for s in slots.values())


def test_devices_per_node_without_a_visibility_list_and_uneven_nodes() -> None:
    slots = map_devices({0: [0, 1], 1: [2], 2: [3, 4, 5]}, 4, None)
    assert {r: (s.node, s.index, s.physical) for r, s in slots.items()} == {
        0: (0, 0, "0"),
        1: (0, 1, "1"),
        2: (1, 0, "0"),
        3: (2, 0, "0"),
        4: (2, 1, "1"),
        5: (2, 2, "2"),
    }
    # fewer devices used than visible is fine; the first N of the list are used
    assert [s.physical for s in map_devices({0: [0, 1]}, 2, "3,1,2").values()] == ["3", "1"]


def test_a_node_with_more_ranks_than_devices_is_refused_naming_the_ranks() -> None:
    with pytest.raises(DeviceMapError, match=r"node 1: ranks 6, 7 have no device: 4 workers, 2 device"):
        map_devices({0: [0, 1], 1: [4, 5, 6, 7]}, None, "0,1")
    with pytest.raises(DeviceMapError, match=r"--devices-per-node 4, but \$CUDA_VISIBLE_DEVICES='0,1'"):
        map_devices({0: [0]}, 4, "0,1")
    with pytest.raises(DeviceMapError, match="is empty"):
        map_devices({0: [0]}, None, "")
    with pytest.raises(DeviceMapError, match="names a device twice"):
        parse_visible("0,1,0")
    with pytest.raises(DeviceMapError, match="--devices-per-node N"):
        map_devices({0: [0]}, None, None)
    with pytest.raises(DeviceMapError, match=">= 1"):
        map_devices({0: [0]}, 0, None)


def test_sharing_wraps_ranks_round_robin_and_marks_them_for_gloo() -> None:
    slots = map_devices({0: [0, 1, 2]}, 1, None, share=True)
    assert [(s.index, s.shared) for s in slots.values()] == [(0, True)] * 3
    assert backend_for("cuda", shared=True) == "gloo" and backend_for("cuda") == "nccl"
    assert backend_for("npu") == "hccl" and backend_for("cpu") == "gloo"
    env = worker_device_env({0: [0, 1, 2]}, 2, {}, share=True, cpus=7)
    assert env == {
        0: {DEVICE_INDEX_ENV: "0", DEVICE_SHARED_ENV: "1", HOST_THREADS_ENV: "2"},
        1: {DEVICE_INDEX_ENV: "1", DEVICE_SHARED_ENV: "1", HOST_THREADS_ENV: "2"},
        2: {DEVICE_INDEX_ENV: "0", DEVICE_SHARED_ENV: "1", HOST_THREADS_ENV: "2"},
    }


def test_worker_env_reads_the_ascend_list_and_stays_empty_for_a_cpu_job() -> None:
    assert worker_device_env({0: [0, 1]}, None, {}) == {}
    env = worker_device_env({0: [0, 1]}, None, {"ASCEND_RT_VISIBLE_DEVICES": "6,7"}, cpus=16)
    assert env == {
        0: {DEVICE_INDEX_ENV: "0", HOST_THREADS_ENV: "8"},
        1: {DEVICE_INDEX_ENV: "1", HOST_THREADS_ENV: "8"},
    }
    with pytest.raises(DeviceMapError, match="ASCEND_RT_VISIBLE_DEVICES"):
        worker_device_env({0: [0, 1, 2]}, None, {"ASCEND_RT_VISIBLE_DEVICES": "6,7"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_accelerator_workers_share_their_nodes_cpus_and_cpu_workers_keep_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from executor.devices import intra_op_threads

    env = worker_device_env({0: [0, 1, 2], 1: [3]}, 4, {}, cpus=16)
    assert [env[r][HOST_THREADS_ENV] for r in range(4)] == ["5", "5", "5", "16"]  # per node
    assert worker_device_env({0: list(range(4))}, 4, {}, cpus=2)[3][HOST_THREADS_ENV] == "1"
    mine = worker_device_env({0: [0, 1]}, 2, {HOST_THREADS_ENV: "3"}, cpus=16)  # the user's choice
    assert mine[0][HOST_THREADS_ENV] == mine[1][HOST_THREADS_ENV] == "3"
    monkeypatch.setenv(HOST_THREADS_ENV, "6")
    assert intra_op_threads("cuda") == 6 and intra_op_threads("npu") == 6
    assert intra_op_threads("cpu") == 1  # whatever is set: a CPU rank's compute is its thread's CPU time
    monkeypatch.setenv(HOST_THREADS_ENV, "0")
    with pytest.raises(ValueError, match="ELASWAVE_HOST_THREADS must be a thread count >= 1, got '0'"):
        intra_op_threads("cuda")
    monkeypatch.delenv(HOST_THREADS_ENV)
    assert intra_op_threads("cuda") == 1
    with pytest.raises(DeviceMapError, match="ELASWAVE_HOST_THREADS must be a thread count >= 1, got 'x'"):
        worker_device_env({0: [0]}, 1, {HOST_THREADS_ENV: "x"})  # refused by the launcher, before any start


def test_a_rank_that_cannot_see_its_device_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailable, match=r"cuda:0, but this process sees 0 cuda device"):
        rank_device("cuda")
    monkeypatch.setenv(DEVICE_INDEX_ENV, "3")
    with pytest.raises(DeviceUnavailable, match=r"cuda:3"):
        rank_device("cuda")
    assert rank_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_kind("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto must pick the CPU here")
def test_train_on_auto_says_cpu_and_on_cuda_fails_before_the_first_step(tmp_path: Path) -> None:
    """A real script: device='auto' trains on the CPU and says so in its first line without
    importing torch_npu; device='cuda' on this machine stops before any step, naming cuda:0."""
    script = tmp_path / "tiny.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            from torch import nn
            from torch.utils.data import TensorDataset
            import elaswave

            data = TensorDataset(torch.randn(16, 4), torch.randn(16))
            def mse(out, y):
                return (out.squeeze(-1) - y) ** 2
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
            steps = []
            elaswave.train(model, mse, data, global_batch=8, steps=2, device=sys.argv[1],
                           on_step=lambda s, loss: steps.append(s))
            print("steps", steps, "torch_npu" in sys.modules)
            """
        )
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    auto = subprocess.run(
        [sys.executable, str(script), "auto"], capture_output=True, text=True, env=env, timeout=120
    )
    assert auto.returncode == 0, auto.stderr
    lines = auto.stdout.splitlines()
    assert lines[0].startswith("elaswave: training on cpu") and "picked cpu" in lines[0], lines
    assert lines[-1] == "steps [0, 1] False"
    cuda = subprocess.run(
        [sys.executable, str(script), "cuda"], capture_output=True, text=True, env=env, timeout=120
    )
    assert cuda.returncode != 0
    assert "DeviceUnavailable: asked to run on cuda:0, but this process sees 0 cuda device" in cuda.stderr
    assert "steps" not in cuda.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_elaswave_run_refuses_a_node_without_a_device_per_worker(tmp_path: Path) -> None:
    """`elaswave run` maps devices after the describe run and before starting anything: two workers
    on a node that lists one device are refused (exit 64) naming the rank left without one."""
    from tests.test_launcher import _tiny, elaswave_run

    script = _tiny(tmp_path)
    run = elaswave_run(
        "--nproc-per-node", "2", "--devices-per-node", "1", script, cwd=tmp_path, timeout_s=150
    )
    assert run.returncode == 64, run.stderr
    assert "node 0: ranks 1 have no device: 2 workers, 1 device(s)" in run.stderr
    assert "Core up" not in run.stdout  # refused before the Core, store or any worker started
