"""The fast path (issue 32) on a CPU: its knobs (auto | true | false) checked before anything heavy and decided for the
machine (auto: on CUDA only), and each piece computing what the plain path computes on the tiny model: Liger's fused
linear cross-entropy (through Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), packed
rows on a varlen attention (torch's kernel replaced by its per-example reference off CUDA), compiled decoder layers
(Dynamo's eager backend), the two MFU counts. What only a GPU proves (Liger's other kernels, torch's varlen kernel,
inductor, speed) is in tests/system/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from ds_exp.core.errors import ConfigError
from ds_exp.fast_path.attention import TORCH_VARLEN, example_boundaries
from ds_exp.fast_path.checks import fast_path_problems as settings_problems
from ds_exp.fast_path.settings import FastPath, FastPathSettings, liger_installed
from ds_exp.model.build import build_model
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.train.flops import FlopsModel
from ds_exp.train.step import batch_loss

ROWS, LENGTH = 2, 24
needs_liger = pytest.mark.skipif(not liger_installed(), reason="liger-kernel is not installed (pip install '.[dev]')")


def built(compose_cfg, *overrides: str):
    cfg = compose_cfg("precision=fp32", f"train.micro_batch_size={ROWS}", f"data.max_seq_len={LENGTH}", *overrides)
    return build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}})


def fast_path_problems(cfg, accelerator: str) -> list[str]:
    return settings_problems(FastPathSettings.of(cfg), accelerator)


def decide(cfg, accelerator: str, zero_stage: int) -> FastPath:
    return FastPathSettings.of(cfg).decide(accelerator, zero_stage)


def labelled_batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (ROWS, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    labels = ids.clone()
    labels[:, :5] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ------------------------------------------------------------------------------------------------ the knobs


def test_fast_path_knobs_are_checked_before_the_run(compose_cfg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fast_path_problems(compose_cfg(), "cpu") == []  # auto everywhere: nothing asked that cannot run
    assert fast_path_problems(compose_cfg("model.liger_kernel=yes", "train.compile=2"), "cpu") == [
        "model.liger_kernel=yes: expected auto, true or false",
        "train.compile=2: expected auto, true or false",
    ]
    problems = fast_path_problems(compose_cfg("model.liger_kernel=true", "model.fused_loss=true"), "cpu")
    assert problems == [
        "model.liger_kernel=true: Liger's kernels are Triton GPU kernels and this is cpu; set model.liger_kernel=auto "
        "(on where they run) or false",
        "model.fused_loss=true: Liger's fused linear cross-entropy is a Triton GPU kernel and this is cpu; set "
        "model.fused_loss=auto (on where it runs) or false",
    ]
    softcapped = compose_cfg("model.fused_loss=true", "+model.arch.final_logit_softcapping=30.0")
    assert fast_path_problems(softcapped, "cuda")[-1].startswith(
        "model.fused_loss=true: this model changes its logits after lm_head (final_logit_softcapping=30.0)"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs the fused loss on the host
    assert fast_path_problems(compose_cfg("model.fused_loss=true"), "cpu") == []


def test_auto_is_the_fast_path_on_cuda_and_the_plain_path_on_cpus(compose_cfg):
    cfg = compose_cfg()
    assert decide(cfg, "cpu", 0) == FastPath(liger_kernel=False, fused_loss=False, compile=False)
    liger = liger_installed()  # on CUDA, where liger-kernel is installed
    assert decide(cfg, "cuda", 2) == FastPath(liger_kernel=liger, fused_loss=liger, compile=True)
    assert not decide(cfg, "cuda", 3).compile  # ZeRO-3's parameter hooks would break every layer's graph
    assert not decide(compose_cfg("+model.arch.final_logit_softcapping=30.0"), "cuda", 2).fused_loss
    assert decide(compose_cfg("model.fused_loss=true"), "cpu", 0).fused_loss  # asked for: validation said if it runs
    off = compose_cfg("model.liger_kernel=false", "model.fused_loss=false", "train.compile=false")
    assert decide(off, "cuda", 0) == FastPath(liger_kernel=False, fused_loss=False, compile=False)
    assert built(compose_cfg).fast_path == {
        "attention": "sdpa",
        "liger_kernel": False,
        "fused_loss": False,
        "compile": False,
    }


# ------------------------------------------------------------------------------------------- the fused loss


def loss_and_grads(model_built, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model = model_built.model
    model.train()
    model.zero_grad()
    summed, count = batch_loss(model_built.loss, model, batch)
    (summed / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(summed.detach() / count), grads


@needs_liger
@pytest.mark.parametrize(
    "overrides",
    [("model.tiled_loss=true",), ("lora.dim=4", "lora.modules_to_save=[lm_head]")],
    ids=["full_with_tiled_loss", "lora_and_a_trained_lm_head"],
)
def test_the_fused_loss_equals_the_plain_loss(compose_cfg, overrides):
    """Loss and every gradient: a full fine-tune (with model.tiled_loss also on: the fused loss replaces it), and LoRA
    in the decoder layers with lm_head trained whole (PEFT's copy of it is the weight the fused loss takes)."""
    plain = built(compose_cfg, *overrides, "model.fused_loss=false")
    fused = built(compose_cfg, *overrides, "model.fused_loss=true")
    assert fused.fast_path["fused_loss"] and fused.loss is not None
    fused.model.load_state_dict(plain.model.state_dict())  # LoRA's adapters start random: the same ones
    batch = labelled_batch(0)
    loss, grads = loss_and_grads(plain, batch)
    fused_loss, fused_grads = loss_and_grads(fused, batch)
    assert fused_loss == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == fused_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # anything that wants logits (evaluation's perplexity, generation) still gets them
        fused.model.eval()
        logits = fused.model(input_ids=batch["input_ids"][:, :5]).logits
    assert logits.shape[-1] == fused.config.vocab_size


def test_the_fused_loss_needs_one_output_weight(compose_cfg):
    lora_on_head = ("lora.dim=4", "lora.module_name=e")  # every Linear layer, lm_head too
    with pytest.raises(ConfigError, match=r"model\.fused_loss=true: the output layer carries LoRA adapters"):
        built(compose_cfg, *lora_on_head, "model.fused_loss=true")
    from ds_exp.fast_path.fused_loss import apply_fused_loss

    model = built(compose_cfg, *lora_on_head, "model.fused_loss=false").model
    assert apply_fused_loss(model, "llama", asked=False) is None  # auto: the plain loss, said in the log


# -------------------------------------------------------------------------------------------- packed rows


def packed_rows() -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int]]]:
    """Two rows of packed examples (position ids restart at each) and the (row, start, end) of each example."""
    ids = torch.randint(5, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    examples = [(0, 0, 5), (0, 5, 12), (0, 12, 16), (1, 0, 9), (1, 9, 16)]
    positions = torch.zeros_like(ids)
    for row, a, b in examples:
        positions[row, a:b] = torch.arange(b - a)
    return {"input_ids": ids, "position_ids": positions}, examples


@pytest.mark.parametrize("attention", ["sdpa", TORCH_VARLEN])
def test_packed_examples_see_only_themselves(compose_cfg, attention):
    """A packed row's logits of each example equal that example's alone (sdpa: transformers' mask from the position
    ids; torch_varlen: the examples' boundaries; eager attention over the rows as one sequence would mix them)."""
    model_built = built(compose_cfg, f"model.attn_implementation={attention}")
    assert (model_built.inputs is example_boundaries) == (attention == TORCH_VARLEN)  # the step hands them over
    model = model_built.model.eval()
    batch, examples = packed_rows()
    boundaries = example_boundaries(batch)
    assert boundaries["cu_seq_lens_q"].tolist() == [0, 5, 12, 16, 25, 32]
    assert boundaries["max_length_q"] == 9
    with torch.no_grad():
        packed = model(**batch, **boundaries, use_cache=False).logits
        crossing = model(input_ids=batch["input_ids"], use_cache=False).logits  # one causal sequence per row
        for row, a, b in examples:
            alone = model(input_ids=batch["input_ids"][row : row + 1, a:b], use_cache=False).logits[0]
            torch.testing.assert_close(packed[row, a:b], alone, rtol=1e-4, atol=1e-5)
            if a:  # a later example that could see the one before it does so without isolation
                assert not torch.allclose(crossing[row, a:b], alone, atol=1e-3)


def test_only_packed_batches_have_example_boundaries():
    ids = torch.ones(2, 6, dtype=torch.long)
    assert example_boundaries({"input_ids": ids, "attention_mask": torch.ones_like(ids)}) == {}
    # a pad tail continues its row's last positions: it stays with the last example
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    assert example_boundaries({"input_ids": ids, "position_ids": positions})["cu_seq_lens_k"].tolist() == [0, 3, 6, 12]


# ------------------------------------------------------------------------------------- compiled decoder layers


def test_compiled_decoder_layers_compute_what_eager_ones_do(compose_cfg):
    from torch._dynamo.utils import counters

    from ds_exp.core import compat
    from ds_exp.fast_path.compile import compile_decoder_layers

    plain = built(compose_cfg)
    compiled = built(compose_cfg)
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(compiled.model, backend="eager") == 2
    batch = labelled_batch(1)
    loss, grads = loss_and_grads(plain, batch)
    compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
    assert compiled_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both layers: compile time is one layer's
    assert compat.compile_seconds() > 0


# ------------------------------------------------------------------------------------------- two MFU counts


def test_mfu_is_given_in_both_counts():
    flops = FlopsModel(matmul_params=1000, trainable_matmul_params=1000, layers=2, hidden=8)
    # a packed row of 16 tokens holding examples of 10 and 6: ds_exp counts each example's attention, torchtitan and
    # llm-foundry every token over its whole row
    assert flops.per_batch(16, 10**2 + 6**2) == 6000 * 16 + 12 * 2 * 8 * 136
    assert flops.per_batch_row_attention(16, 16) == (6000 + 12 * 2 * 8 * 16) * 16
    lora = FlopsModel(matmul_params=1000, trainable_matmul_params=10, layers=2, hidden=8)
    assert lora.matmul_per_token == 4 * 1000 + 2 * 10  # LoRA: 4 N + 2 N_trainable


# ------------------------------------------------------------------------------------------------ the planner


def test_the_planner_picks_the_largest_micro_batch_that_fits_without_checkpointing(compose_cfg):
    from dataclasses import replace

    from ds_exp.config.memory_plan import plan_micro_batch, run_estimate
    from ds_exp.model.architecture import model_facts

    cfg = compose_cfg("precision=bf16", "data.max_seq_len=4096")
    facts = model_facts(cfg)

    def estimate(micro: int, checkpointing: bool) -> int:
        one = replace(cfg, train=replace(cfg.train, micro_batch_size=micro))
        one = replace(one, model=replace(one.model, gradient_checkpointing=checkpointing))
        return run_estimate(one, facts, world_size=1, precision="bf16", accelerator="cuda")["estimate_bytes"]

    def plan(device_bytes: float) -> tuple[int, bool]:
        return plan_micro_batch(cfg, facts, int(device_bytes / 0.85) + 2, precision="bf16", world_size=1)

    assert plan(estimate(16, False)) == (16, False)
    assert plan(estimate(4, False)) == (4, False)
    assert plan(estimate(1, False)) == (1, False)  # a smaller batch before any recomputation
    assert estimate(1, True) < estimate(1, False)  # checkpointing fits where nothing else does
    assert plan(estimate(1, True)) == (1, True)
    assert plan(1) == (1, True)  # nothing fits: the run says so itself
