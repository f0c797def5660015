"""`transformers` causal LMs as units (docs/huggingface.md): tiny Llama and Qwen2 models with tied
embeddings train as a plain `transformers` + `torch.optim` loop does, in one process and on
PP=2 x DP=2 with the tied pair on two stages (fp32 round-off in every loss and the final state);
a checkpoint written on PP=2 x DP=2 resumes on PP=3 x DP=1 tied; export and import round-trip
through `from_pretrained`; recomputation changes no bit; bad input fails before the first step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import elaswave
from elaswave.cli import main as cli_main
from elaswave.data import TokenFile, TokenFileError
from elaswave.hf import UnsupportedModel, causal_lm, token_loss
from executor.checkpoint import load_model_state
from executor.launch import JobSpec, job_losses, merged_state, run_job
from planners.layout import Layout, StageLayout
from tests.api.hf_cases import (
    BATCH,
    LR,
    SEQ,
    SLOTS,
    UNITS,
    WD,
    assert_states_close,
    hf_spec,
    reference,
    tied_pair,
    tiny_config,
    token_file,
    unit_state,
)

transformers = pytest.importorskip("transformers", reason="the optional extra elaswave[hf]")

STEPS = 5
REL = 2e-6  # loss: fp32 round-off (the engine adds micro-batch gradients, the reference one batch)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return token_file(tmp_path_factory.mktemp("tokens"))


def layout(bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]], numel: tuple[int, ...]) -> Layout:
    stages = tuple(
        StageLayout(p, lo, hi, r) for p, ((lo, hi), r) in enumerate(zip(bounds, ranks, strict=True))
    )
    return Layout(len(UNITS), BATCH, SLOTS, stages, numel)


def train_one_process(config: object, data: Path, steps: int = STEPS, **kw: object) -> elaswave.TrainResult:
    return elaswave.train(
        causal_lm(config, **kw),  # type: ignore[arg-type]
        token_loss,
        TokenFile(data, SEQ),
        global_batch=BATCH,
        micro_batches=SLOTS,
        steps=steps,
        optimizer=elaswave.AdamW(lr=LR, weight_decay=WD),
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_process_matches_the_transformers_loop(kind: str, data: Path) -> None:
    config = tiny_config(kind)
    want_losses, want_state = reference(config, data, STEPS)
    result = train_one_process(config, data)
    assert [result.losses[s] for s in range(STEPS)] == pytest.approx(want_losses, rel=REL)
    assert result.state_dict is not None
    assert_states_close(result.state_dict, want_state)
    embed, head = tied_pair(config)
    assert torch.equal(result.state_dict[embed], result.state_dict[head])


def test_clipping_counts_the_tied_weight_once(data: Path) -> None:
    config = tiny_config("qwen2")
    want_losses, want_state = reference(config, data, STEPS, max_grad_norm=0.05)  # clips every step
    result = elaswave.train(
        causal_lm(config),
        token_loss,
        TokenFile(data, SEQ),
        global_batch=BATCH,
        micro_batches=SLOTS,
        steps=STEPS,
        optimizer=elaswave.AdamW(lr=LR, weight_decay=WD, max_grad_norm=0.05),
    )
    assert [result.losses[s] for s in range(STEPS)] == pytest.approx(want_losses, rel=REL)
    assert result.state_dict is not None
    assert_states_close(result.state_dict, want_state)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_units_compute_what_the_model_computes_and_keys_map_one_to_one(kind: str) -> None:
    config = tiny_config(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    units = causal_lm(model)
    x = torch.randint(0, config.vocab_size, (3, SEQ))
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding crosses the units as a tuple member
    with torch.no_grad():
        h: object = (x, mask)
        state = {}
        for i, name in enumerate(units.names):
            unit = units.build(i).eval()
            h = unit(*h) if isinstance(h, tuple) else unit(h)
            state.update({f"{name}.{k}": v for k, v in unit.state_dict().items()})
        want = model.eval()(x, attention_mask=mask).logits
    assert torch.equal(h, want)  # type: ignore[arg-type]
    hf_keys = {elaswave.hf.to_hf_key(config, k) for k in state}
    assert hf_keys == set(model.state_dict())
    assert all(elaswave.hf.from_hf_key(config, elaswave.hf.to_hf_key(config, k)) == k for k in state)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_pp2_dp2_qwen2_with_the_tied_pair_on_two_stages_matches_the_transformers_loop(data: Path) -> None:
    config = tiny_config("qwen2")
    spec = hf_spec(config, data)
    job = JobSpec(spec, layout([(0, 2), (2, 4)], [(0, 1), (2, 3)], spec.unit_numels()), STEPS, timeout_s=60.0)
    results = run_job(job)
    want_losses, want_state = reference(config, data, STEPS)
    assert job_losses(results) == pytest.approx(want_losses, rel=REL)
    got = unit_state(spec.model, {n: u["param"] for n, u in merged_state(results)["units"].items()})
    assert_states_close(got, want_state)
    embed, head = tied_pair(config)
    assert torch.equal(got[embed], got[head])  # the two stages' copies: the same bits


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_pp2_dp2_llama_matches_the_transformers_loop_and_its_checkpoint_resumes_on_pp3_dp1_tied(
    data: Path, tmp_path: Path
) -> None:
    config, at = tiny_config("llama"), 2
    spec = hf_spec(config, data)
    numel = spec.unit_numels()
    first = JobSpec(
        spec,
        layout([(0, 2), (2, 4)], [(0, 1), (2, 3)], numel),
        STEPS,
        checkpoint_dir=str(tmp_path),
        checkpoint_steps=(at,),
        timeout_s=60.0,
    )
    results = run_job(first)
    want_losses, want_state = reference(config, data, STEPS)
    assert job_losses(results) == pytest.approx(want_losses, rel=REL)
    got = unit_state(spec.model, {n: u["param"] for n, u in merged_state(results)["units"].items()})
    assert_states_close(got, want_state)
    embed, head = tied_pair(config)
    assert torch.equal(got[embed], got[head])  # the two stages' copies: the same bits
    saved = torch.load(tmp_path / "step-00000003" / "model" / "head.pt", weights_only=True)
    assert "lm_head.weight" not in saved  # the checkpoint stores the tied weight once
    resumed = dataclasses.replace(
        first,
        layout=layout([(0, 1), (1, 3), (3, 4)], [(0,), (1,), (2,)], numel),
        checkpoint_steps=(STEPS - 1,),
        resume_dir=str(tmp_path),
    )
    assert job_losses(run_job(resumed)) == pytest.approx(want_losses[at + 1 :], rel=REL)
    final = load_model_state(tmp_path)
    assert torch.equal(final[embed], final[head])
    assert_states_close(final, want_state)


def test_export_hf_loads_with_from_pretrained_and_gives_the_same_logits(data: Path, tmp_path: Path) -> None:
    config = tiny_config("qwen2")
    result = elaswave.train(
        causal_lm(config),
        token_loss,
        TokenFile(data, SEQ),
        global_batch=BATCH,
        steps=2,
        checkpoint_dir=tmp_path / "ckpt",
    )
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied again
    units = causal_lm(config, state_dict=result.state_dict)
    x = TokenFile(data, SEQ)[0][0].unsqueeze(0)
    with torch.no_grad():
        h: object = x
        for i in range(len(units)):
            unit = units.build(i).eval()
            h = unit(*h) if isinstance(h, tuple) else unit(h)
        want = model(x).logits
    assert torch.allclose(h, want, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]


def test_a_from_pretrained_directory_gives_the_first_loss_of_that_model(data: Path, tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.save_pretrained(tmp_path / "pretrained")
    result = elaswave.train(
        causal_lm(str(tmp_path / "pretrained")), token_loss, TokenFile(data, SEQ), global_batch=BATCH, steps=1
    )
    rows = [TokenFile(data, SEQ)[i] for i in range(len(TokenFile(data, SEQ)))]
    from executor.sampler import GlobalBatchSampler

    batch = GlobalBatchSampler(TokenFile(data, SEQ), BATCH).rows(0, 0, BATCH)
    with torch.no_grad():
        want = float(token_loss(model(batch.inputs).logits, batch.targets).mean())
    assert rows and result.losses[0] == pytest.approx(want, rel=1e-6)


def test_recompute_on_and_off_are_bitwise_equal(data: Path) -> None:
    config = tiny_config("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # dropout inside units
    plain = train_one_process(config, data, steps=2)
    again = train_one_process(config, data, steps=2, recompute=True)
    some = train_one_process(config, data, steps=2, recompute=["layer1", "head"])
    assert plain.losses == again.losses == some.losses
    assert plain.state_dict is not None and again.state_dict is not None and some.state_dict is not None
    for key, value in plain.state_dict.items():
        assert torch.equal(value, again.state_dict[key]) and torch.equal(value, some.state_dict[key]), key


def test_bad_input_fails_before_the_first_step(data: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="model type 'bert' is not supported .* elaswave.Units"):
        causal_lm(transformers.BertConfig())
    with pytest.raises(UnsupportedModel, match="cannot be split into units: num_hidden_layers must be >= 1"):
        causal_lm(tiny_config("llama", num_hidden_layers=0))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02\x00\x03\x00")  # 3 uint16 tokens
    with pytest.raises(TokenFileError, match="not a whole number of uint32 tokens"):
        TokenFile(odd, 2, dtype="uint32")
    with pytest.raises(TokenFileError, match="holds 3 tokens: one window of seq_len=8 needs 9"):
        TokenFile(odd, 8)
    with pytest.raises(TokenFileError, match=r"token id \d+ >= vocab_size 64"):
        TokenFile(data, SEQ, dtype="uint32", vocab_size=64)  # a uint16 file read as uint32
    steps: list[int] = []
    with pytest.raises(ValueError, match="token_loss needs logits"):
        elaswave.train(
            causal_lm(tiny_config("llama")),
            lambda out, y: token_loss(out, y[:, :-1]),  # targets cut short
            TokenFile(data, SEQ),
            global_batch=BATCH,
            steps=2,
            on_step=lambda s, _loss: steps.append(s),
        )
    assert steps == []
