"""Paper-scale jobs and their analytic per-layer profile.

Jobs follow ElasWave Table 2 (Llama2-7B/13B/34B on 96 Ascend 910B NPUs, 8 per node) and
Chameleon §V (Llama2-7B on 32 NPUs). Per-layer costs come from an analytic model:

- FLOPs of one transformer block per token, forward: `2 * params_per_layer + 4 * seq * hidden`
  (the dense matmuls, plus QK^T and AV); backward = 2x forward (Narayanan et al., SC'21).
- Seconds per sample per layer per device = FLOPs * seq / (TP * peak * MFU). Peak 313 TFLOP/s
  (910B fp16); MFU 0.30 reproduces the order of ElasWave Table 3 (34B: 8.5 samples/s).
- Memory per device: bf16 weights and gradients (2 B + 2 B per parameter, / TP), fp32 master
  and Adam moments (12 B per parameter) sharded ZeRO-1 over the stage's DP ranks, activations
  `34 * seq * hidden` bytes per sample per layer / TP (Korthikanti et al. 2022, with sequence
  parallelism); eq. (14) multiplies them by the micro-batches in flight.
- Activation transfer between stages: `2 * seq * hidden` bytes per sample / TP over a 200 Gb/s
  link (ElasWave §7.1); gradient all-reduce and layer migration over 25 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from planners.chameleon.state import JobProfile, JobShape

PEAK_FLOPS = 313e12
DEFAULT_MFU = 0.30
LINK_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    ffn: int
    kv_heads_ratio: float  # kv heads / attention heads (GQA)
    seq_len: int = 4096

    @property
    def params_per_layer(self) -> float:
        h = self.hidden
        attention = 2 * h * h + 2 * h * h * self.kv_heads_ratio
        return attention + 3 * h * self.ffn


LLAMA2 = {
    "7b": ModelSpec("llama2-7b", 32, 4096, 11008, 1.0),
    "13b": ModelSpec("llama2-13b", 40, 5120, 13824, 1.0),
    "34b": ModelSpec("llama2-34b", 48, 8192, 22016, 0.125),
}


@dataclass(frozen=True)
class JobSpec:
    """A job of the evaluation: model, (TP, PP, DP), batch sizes and device memory."""

    name: str
    model: ModelSpec
    shape: JobShape
    devices_per_node: int
    mem_cap_gib: float
    mfu: float = DEFAULT_MFU

    @property
    def num_nodes(self) -> int:
        return -(-self.shape.num_devices // self.devices_per_node)

    def profile(self) -> JobProfile:
        m, tp = self.model, self.shape.tp
        flops_fwd = (2 * m.params_per_layer + 4 * m.seq_len * m.hidden) * m.seq_len
        fwd_s = flops_fwd / (tp * PEAK_FLOPS * self.mfu)
        param_bytes = 2 * m.params_per_layer / tp
        act_bytes = 34 * m.seq_len * m.hidden / tp
        p2p = 2 * m.seq_len * m.hidden / tp / LINK_BYTES_PER_S
        n = m.layers
        return JobProfile(
            layer_fwd_s=(fwd_s,) * n,
            layer_bwd_s=(2 * fwd_s,) * n,
            layer_param_bytes=(param_bytes,) * n,
            layer_act_bytes=(act_bytes,) * n,
            mem_cap_bytes=self.mem_cap_gib * 2**30,
            p2p_s_per_sample=p2p,
            allreduce_bytes_per_s=LINK_BYTES_PER_S,
            migrate_bytes_per_s=LINK_BYTES_PER_S,
        )


JOBS: dict[str, JobSpec] = {
    # ElasWave Table 2: (TP, PP, DP), micro-batch, global batch; 910B with 32 GB (§7.1).
    "llama2-7b": JobSpec(
        "llama2-7b", LLAMA2["7b"], JobShape(pp=3, dp=8, micro_batch=4, global_batch=8192, tp=4), 8, 32
    ),
    "llama2-13b": JobSpec(
        "llama2-13b", LLAMA2["13b"], JobShape(pp=6, dp=4, micro_batch=2, global_batch=2048, tp=4), 8, 32
    ),
    "llama2-34b": JobSpec(
        "llama2-34b", LLAMA2["34b"], JobShape(pp=8, dp=3, micro_batch=1, global_batch=768, tp=4), 8, 32
    ),
    # Chameleon §V: Llama2-7B on 32 NPUs (64 GB), micro-batch 1, batch 16-64; PP=4, DP=8, TP=1.
    "chameleon-7b": JobSpec(
        "chameleon-7b", LLAMA2["7b"], JobShape(pp=4, dp=8, micro_batch=1, global_batch=64, tp=1), 8, 64
    ),
}


def job(name: str) -> JobSpec:
    try:
        return JOBS[name]
    except KeyError:
        raise ValueError(f"unknown job {name!r}; known jobs: {sorted(JOBS)}") from None


def node_of_rank(spec: JobSpec, rank: int) -> list[int]:
    """Nodes holding a rank's TP group (devices are numbered TP-innermost, rank-major)."""
    tp, per_node = spec.shape.tp, spec.devices_per_node
    return sorted({d // per_node for d in range(rank * tp, (rank + 1) * tp)})


def ranks_of_devices(spec: JobSpec, dead_devices: set[int]) -> frozenset[int]:
    """Ranks that lost at least one device of their TP group."""
    return frozenset(d // spec.shape.tp for d in dead_devices if d < spec.shape.num_devices)
