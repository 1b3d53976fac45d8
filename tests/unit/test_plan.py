"""One plan for every caller (ds_exp/config/plan.py plan_run): the recipe, the dry run, autotune and the memory bench
plan a run alike, and count data-parallel ranks (world size / dist.sequence_parallel_size), not the world size."""

from __future__ import annotations

import pytest

from bench.memory_probe import prepare
from ds_exp.config.plan import plan_run
from ds_exp.data.pipeline import count_train_examples
from ds_exp.tools.autotune import Autotune
from ds_exp.tools.dry_run import make_plan

WORLD, SP, MICRO, ACCUMULATION, ROWS = 4, 2, 2, 3, 300


@pytest.fixture
def sequence_parallel(compose_cfg, cache_dir, monkeypatch):
    """A run of 4 ranks in sequence-parallel pairs (2 data-parallel ranks), over one epoch of 300 rows."""
    for name, value in {"WORLD_SIZE": WORLD, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": WORLD}.items():
        monkeypatch.setenv(name, str(value))
    return compose_cfg(
        "dist.launcher=env",
        f"dist.sequence_parallel_size={SP}",
        f"train.micro_batch_size={MICRO}",
        f"train.gradient_accumulation_steps={ACCUMULATION}",
        "train.max_steps=-1",
        "train.epochs=1",
        "scheduler.warmup_ratio=0.1",
        f"data.synthetic.num_train={ROWS}",
        f"data.cache_dir={cache_dir}",
    )


def test_every_caller_plans_a_sequence_parallel_run_alike(sequence_parallel, tmp_path):
    cfg = sequence_parallel
    dry = make_plan(cfg, tmp_path, count_train_examples(cfg.data))  # the dry run, with what the CLI counted
    # the recipe's inputs: the tokenized set, the model config's hidden size (the bench makes them the same way)
    _, data, bench = prepare(cfg, WORLD, dry["precision"], str(tmp_path))
    recipe = plan_run(
        cfg,
        world_size=WORLD,
        train_examples=len(data.train),
        hidden_size=dry["hidden_size"],
        precision=dry["precision"],
        run_dir=tmp_path,
    )
    tuned = Autotune().plan(cfg, WORLD, dry["accelerator"], tmp_path)

    global_batch = MICRO * ACCUMULATION * (WORLD // SP)  # 12: two data-parallel ranks, not four
    assert recipe.data_parallel_size == WORLD // SP and recipe.global_batch_size == global_batch
    assert recipe.total_steps == ROWS // global_batch == 25 and recipe.warmup_steps == 3
    assert recipe.ds_config["train_batch_size"] == global_batch and recipe.ds_config["sequence_parallel_size"] == SP
    assert bench == recipe and tuned == recipe
    assert (dry["data_parallel_size"], dry["global_batch_size"], dry["total_steps"]) == (2, global_batch, 25)
    assert dry["ds_config"] == recipe.ds_config


TINY = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=1"]


def test_a_preference_pair_is_planned_as_two_rows_with_no_second_model(compose_cfg, tmp_path):
    """The dry run of objective=dpo or reward (autotune's estimate is the same run_estimate): a micro batch of 4 pairs
    holds the activations of SFT's 8 rows, the model states are SFT's (DPO's reference is no second copy), and the
    plan names where the reference comes from. A reward model is planned as the model it trains: a one-wide head
    instead of the output layer (gone untied), no vocabulary-wide logits."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    def plan(*overrides: str) -> dict:
        return make_plan(compose_cfg(*TINY, *overrides), tmp_path, train_examples=64)

    sft, sft_rows = plan("train.micro_batch_size=4"), plan("train.micro_batch_size=8")
    activations = {name: plan(f"objective={name}", "train.micro_batch_size=4") for name in ("dpo", "reward")}
    for name, pairs in activations.items():
        assert pairs["micro_batch_size"] == 4 and pairs["global_batch_size"] == sft["global_batch_size"]
        assert f"objective={name}: each pair is two rows (the activations above count both)" in pairs["notes"][-1]
    dpo, reward = (activations[name]["memory_per_rank"]["activation_bytes"] for name in ("dpo", "reward"))
    rows = sft["memory_per_rank"]["activation_bytes"]
    assert dpo == sft_rows["memory_per_rank"]["activation_bytes"] > rows
    assert activations["dpo"]["estimate_per_rank_bytes"] - dpo == sft["estimate_per_rank_bytes"] - rows
    # 8 rows' logits, fp32 with the loss's copy (12 bytes each): the vocabulary's wide for SFT, one for a reward
    tokens, vocab = 8 * compose_cfg().data.max_seq_len, sft["padded_vocab_size"]
    assert dpo - reward == tokens * (vocab - 1) * 12
    for tied in ("true", "false"):
        untied = [f"model.arch.tie_word_embeddings={tied}"]
        counted = plan(*untied, "objective=reward")["parameters"]
        arch = {**compose_cfg(*TINY, *untied).model.arch, "vocab_size": vocab, "num_labels": 1}
        config = AutoConfig.for_model(**arch)
        with torch.device("meta"):
            built = AutoModelForSequenceClassification.from_config(config)
        assert counted == sum(p.numel() for p in built.parameters()) < plan(*untied)["parameters"] + 33
    precomputed = plan("objective=dpo")["notes"][-1]
    assert "DPO's reference: log-probabilities of the starting model, computed once before training" in precomputed
    adapters = plan("objective=dpo", "lora.dim=8")["notes"][-1]
    assert "DPO's reference: the same weights with the LoRA adapters off (no second copy" in adapters
