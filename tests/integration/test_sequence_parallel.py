"""dist.sequence_parallel_size (Ulysses, DeepSpeed's ALST): the pieces in this process (a rank's slice of a batch,
documents kept apart, the batch arithmetic, the checks before heavy work), then real engines: N=2 on 2 ranks against
1 rank on the same global batch (fp32, losses and gradient norms within 1e-5), resume with N changed, and a real
pretrained model at N=3."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_exp.config.ds_config import RunFacts, resolve_ds_config
from ds_exp.config.features import CheckFacts
from ds_exp.config.ranges import range_problems
from ds_exp.core.errors import ConfigError
from ds_exp.fast_path.settings import liger_installed
from ds_exp.sequence_parallel.checks import sequence_parallel_problems, zero_problems
from ds_exp.sequence_parallel.settings import SequenceParallelSettings
from ds_exp.sequence_parallel.ulysses import SequenceShard, check_heads, isolate_documents
from ds_exp.train.collate import SFTCollator
from ds_exp.train.step import IGNORE_INDEX, Ranks, loss_labels, token_loss_sum

# ---------------------------------------------------------------------------------------------- in this process


def test_each_rank_keeps_its_slice_and_the_labels_its_tokens_predict():
    assert Ranks.of(rank=3, world_size=4, size=2) == Ranks(size=2, rank=1, dp_rank=1, dp_size=2)
    collate = SFTCollator(pad_token_id=0, pad_to_multiple_of=2, position_ids=True)
    full = collate(
        [
            {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9]},
            {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
        ]
    )
    assert full["input_ids"].shape == (2, 6)  # 5 tokens, padded to a multiple of N, never refused
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]] * 2  # pads count on: behind every real token
    assert full["attention_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]  # kept on the host: tokens are counted from it
    slices = [SequenceShard(size=2, rank=rank)(full) for rank in (0, 1)]
    assert all(set(s) == {"input_ids", "position_ids", "shift_labels"} for s in slices)
    joined = {k: torch.cat([s[k] for s in slices], dim=1) for k in slices[0]}
    assert torch.equal(joined["input_ids"], full["input_ids"])
    assert torch.equal(joined["position_ids"], full["position_ids"])
    # rank 0's last position predicts rank 1's first token: labels are shifted on the whole row, then cut
    assert slices[0]["shift_labels"][0].tolist() == [IGNORE_INDEX, 7, 8]
    assert slices[1]["shift_labels"][0].tolist() == [9, IGNORE_INDEX, IGNORE_INDEX]
    # the two slices' token losses are the whole row's
    logits = torch.randn(2, 6, 11)
    whole = token_loss_sum(logits, full["labels"])
    parts = [token_loss_sum(logits[:, 3 * r : 3 * r + 3], **loss_labels(s)) for r, s in enumerate(slices)]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole[0]))
    assert int(sum(p[1] for p in parts)) == int(whole[1]) == 3 + 2


def sdpa_core(module, query, key, value, attention_mask, *args, **kwargs):
    """An attention function with transformers' contract ([rows, heads, length, dim] in, [rows, length, heads, dim]
    out; causal where no mask is given), on torch alone."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None
    )
    return out.transpose(1, 2), None


def test_packed_documents_attend_only_to_themselves():
    """ds_exp's per-document attention equals attention with a block-diagonal causal mask; plain causal attention
    over the row (what DeepSpeed's wrapper leaves for sdpa) does not."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])  # row 0: two documents
    document = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    mask = (document[:, :, None] == document[:, None, :]) & causal  # [rows, query, key]
    expected, _ = sdpa_core(None, q, k, v, mask[:, None])
    isolated, _ = isolate_documents(sdpa_core)(None, q, k, v, None, position_ids=positions)
    torch.testing.assert_close(isolated, expected, rtol=1e-5, atol=1e-6)
    plain, _ = sdpa_core(None, q, k, v, None, position_ids=positions)
    assert not torch.allclose(plain[0], expected[0], atol=1e-3)  # the second document saw the first
    torch.testing.assert_close(plain[1], expected[1], rtol=1e-5, atol=1e-6)  # one document: nothing to isolate


def test_the_global_batch_counts_data_parallel_ranks(compose_cfg):
    cfg = compose_cfg(
        "dist.sequence_parallel_size=2", "train.micro_batch_size=3", "train.gradient_accumulation_steps=2"
    )
    facts = dict(hidden_size=8, total_steps=5, precision="fp32", run_dir="/run")
    ds = resolve_ds_config(cfg, RunFacts(world_size=4, sequence_parallel_size=2, **facts))
    # DeepSpeed's own check: micro x accumulation x world / N; the key lets transformers' ZeRO-3 config agree
    assert (ds["train_batch_size"], ds["sequence_parallel_size"]) == (3 * 2 * 2, 2)
    plain = resolve_ds_config(compose_cfg(), RunFacts(world_size=4, **facts))
    assert "sequence_parallel_size" not in plain  # absent unless on: DeepSpeed then divides by nothing
    wrong = compose_cfg("dist.sequence_parallel_size=2", "train.micro_batch_size=3", "train.global_batch_size=12")
    with pytest.raises(ConfigError, match=r"holds only at 4 data-parallel ranks .* 4 rank\(s\) = 2 data-parallel"):
        resolve_ds_config(wrong, RunFacts(world_size=4, sequence_parallel_size=2), partial=True)


def test_what_sequence_parallelism_cannot_run_is_said_before_heavy_work(compose_cfg, monkeypatch):
    base = compose_cfg()  # composed once; each case changes the typed config the checks read

    def problems(world: int = 4, n: int = 2, stage: int = 0, reduce_scatter: bool | None = None, **changes) -> str:
        cfg = copy.deepcopy(base)
        cfg.dist.sequence_parallel_size = n
        for key, value in changes.items():  # e.g. model__attn_implementation="sdpa"
            group, name = key.split("__")
            setattr(getattr(cfg, group), name, value)
        ds = {"zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter}}
        settings = SequenceParallelSettings.of(cfg)
        return "\n".join(
            sequence_parallel_problems(settings, world) + zero_problems(settings, CheckFacts(world, "cpu", ds))
        )

    assert problems() == ""
    assert problems(data__packing=True, model__attn_implementation="sdpa") == ""
    assert problems(n=0) == ""  # below 1: its field's range says it, once
    below = copy.deepcopy(base)
    below.dist.sequence_parallel_size = 0
    assert (
        "dist.sequence_parallel_size",
        "dist.sequence_parallel_size=0: must be >= 1 (1 = off; N > 1 shards every sample's sequence over N ranks)",
    ) in range_problems(below)
    assert "does not divide the world size 4" in problems(n=3)
    kv = problems(n=4, model__arch={**base.model.arch, "num_attention_heads": 12, "num_key_value_heads": 3})
    assert "model's 3 key/value heads (model.arch) do not divide one another" in kv
    # fewer key/value heads than N, dividing it: DeepSpeed replicates them
    assert problems(n=4, model__arch={**base.model.arch, "num_key_value_heads": 2}) == ""
    assert "train.eval_micro_batch_size=null" in problems(train__eval_micro_batch_size=2)
    assert "leave zero.reduce_scatter unset" in problems(stage=3, reduce_scatter=False)
    assert problems(stage=3) == ""  # DeepSpeed's default (on): its factor is compensated (ds_exp/core/compat/)
    monkeypatch.setattr("ds_exp.sequence_parallel.checks.importlib.metadata.version", lambda name: "0.16.9")
    assert "this is DeepSpeed 0.16.9: pip install -U 'deepspeed>=0.17'" in problems()
    # a hub model's heads are checked once its config is loaded, before its data and weights
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="does not divide the model's 9 attention heads"):
        check_heads(smollm2, 2)
    check_heads(smollm2, 3)


def test_the_sweep_report_has_world_dp_and_sp_columns(tmp_path):
    from ds_exp.sweeps.report import job_row

    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- dist.sequence_parallel_size=2\n")
    summary = {"status": "completed", "world_size": 4, "data_parallel_size": 2, "sequence_parallel_size": 2}
    (job / "summary.json").write_text(json.dumps(summary))
    row = job_row(job)
    assert (row["world_size"], row["dp"], row["sp"]) == (4, 2, 2)
    (job / "summary.json").write_text(json.dumps({"status": "completed", "world_size": 2}))  # an older run's
    assert (job_row(job)["dp"], job_row(job)["sp"]) == (2, 1)


# ------------------------------------------------------------------------------------------------ real engines
# fp32 on CPU: the two sides differ only in the order of floating-point sums (measured <= 2e-7 relative)
RTOL = 1e-5
SMALL = ["data.synthetic.num_train=256", "data.synthetic.num_eval=32", "train.log_every=1"]


def assert_within(a: list[float], b: list[float], rtol: float = RTOL) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y)), f"item {i}: {x} vs {y} (all: {a} vs {b})"


@pytest.mark.slow
def test_parity_checker_finds_sp2_on_two_ranks_equal_to_one_rank_packed_with_accumulation(tmp_path, cache_dir):
    """ZeRO-2, packed rows (documents kept apart under sequence parallelism), accumulation 2: the parity checker
    counts data-parallel ranks (2 ranks / N=2 = 1) in the global batch and compares 6 steps at 1e-5."""
    from tests.integration.test_parity import explain, parity, result

    same = ["zero=stage2", "data.packing=true", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2"]
    tolerance = ["--loss-rtol", str(RTOL), "--grad-rtol", str(RTOL), "--steps", "6"]
    proc = parity(tmp_path, cache_dir, "--ranks", "2,1", *tolerance, a=[*same, "dist.sequence_parallel_size=2"], b=same)
    assert proc.returncode == 0, explain(proc)
    assert "PASS: 6 steps within tolerance" in proc.stdout
    rows = result(tmp_path)["rows"]
    assert all(r["grad_norm_a"] and r["grad_norm_b"] for r in rows)  # gradients compared, not only losses
    summary = json.loads((tmp_path / "cmp" / "A" / "summary.json").read_text())
    assert (summary["world_size"], summary["data_parallel_size"], summary["sequence_parallel_size"]) == (2, 1, 2)


def sp_launch(run_dir: Path, cache_dir: Path, *overrides: str, ranks: int, env: dict[str, str] | None = None):
    from tests.training import launch, train_here

    common = [*SMALL, "zero=stage3", "lora.dim=8", "train.max_steps=6", "eval.prompts=[hello]", "eval.max_new_tokens=4"]
    if ranks == 1:  # the reference: one rank, in this process
        return train_here(run_dir, *common, *overrides, cache_dir=cache_dir, env=env)
    return launch(
        run_dir, *common, *overrides, launcher="ranks", nproc=ranks, cache_dir=cache_dir, env=env, timeout=900
    )


def train_and_eval(run) -> tuple[list[float], list[float], list[float]]:
    evals = [r["eval_loss"] for r in run.records("eval")]
    return run.losses, [r["grad_norm"] for r in run.records("train")], evals


def dry_run_of(run, world: int, compose_cfg, monkeypatch) -> dict:
    """What `dry_run=true` plans for a run's own command line at its world size (ds_exp/tools/dry_run.py)."""
    from omegaconf import OmegaConf

    from ds_exp.tools.dry_run import make_plan

    overrides = [o for o in OmegaConf.load(run.run_dir / ".hydra" / "overrides.yaml") if not o.startswith("hydra.")]
    with monkeypatch.context() as env:  # rank 0 of `world` ranks, for this call only (launches inherit os.environ)
        for name, value in {"WORLD_SIZE": world, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": world}.items():
            env.setenv(name, str(value))
        return make_plan(compose_cfg(*overrides, "dist.launcher=env"), run.run_dir)


@pytest.mark.slow
def test_sp2_at_zero3_with_lora_equals_one_rank_and_resumes_with_n_changed(
    tmp_path, cache_dir, compose_cfg, monkeypatch
):
    """ZeRO-3 + LoRA, accumulation 2: losses, gradient norms (clipping at 1.0 bites at step 5) and eval perplexity
    of N=2 on 2 ranks equal one rank's; generations run unsharded; the exports hold the same weights. Its step-3
    checkpoint then continues on 2 ranks with N=1 (same global batch: micro 2 x accumulation 1 x 2 data-parallel)
    exactly as the N=2 run went on: N is no part of a checkpoint's layout. The N=2 run computes its loss through
    Liger's fused kernel (Triton's interpreter on a CPU), the others from the logits: the fused loss is exact over
    each rank's slice, with its labels shifted across slices, at ZeRO-3 with the weight partitioned over 2 ranks.
    The N=2 run trained with the plan a dry run of its command makes (one plan for every caller: config/plan.py)."""
    from safetensors.torch import load_file

    batch = ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2", "train.save_every=3"]
    fused = ("model.fused_loss=true",) if liger_installed() else ()  # the dev extra has it
    sp_n2 = ("dist.sequence_parallel_size=2", *fused)
    sp = sp_launch(tmp_path / "sp", cache_dir, *batch, *sp_n2, ranks=2, env={"TRITON_INTERPRET": "1"})
    assert sp.ok, sp.explain()
    planned = dry_run_of(sp, 2, compose_cfg, monkeypatch)
    assert json.loads(json.dumps(planned["ds_config"])) == json.loads((sp.run_dir / "ds_config.json").read_text())
    assert (planned["data_parallel_size"], planned["global_batch_size"], planned["total_steps"]) == (
        sp.summary["data_parallel_size"],
        sp.summary["global_batch_size"],
        sp.summary["total_steps"],
    )
    one = sp_launch(tmp_path / "one", cache_dir, *batch, ranks=1)
    assert one.ok, one.explain()
    (sp_losses, sp_norms, sp_evals), (losses, norms, evals) = train_and_eval(sp), train_and_eval(one)
    assert len(sp_losses) == 6 and len(sp_evals) == 2
    assert max(norms) > 1.0  # clipping decides a step: a gradient N times off would show
    assert_within(sp_losses, losses)
    assert_within(sp_norms, norms)
    assert_within(sp_evals, evals)  # perplexity over the whole eval set, exact under sharding
    summary = sp.summary
    assert (summary["data_parallel_size"], summary["sequence_parallel_size"]) == (1, 2)
    assert summary["fast_path"]["fused_loss"] == bool(fused)
    assert [json.loads(line)["step"] for line in (sp.run_dir / "generations.jsonl").read_text().splitlines()] == [0, 6]
    exported = [load_file(run.run_dir / "hf_model" / "model.safetensors") for run in (sp, one)]
    assert exported[0].keys() == exported[1].keys()
    for name, weight in exported[0].items():
        torch.testing.assert_close(weight, exported[1][name], rtol=1e-4, atol=1e-5, msg=name)

    resumed = sp_launch(
        tmp_path / "resumed",
        cache_dir,
        "train.micro_batch_size=2",
        "train.gradient_accumulation_steps=1",
        f"resume={sp.run_dir / 'checkpoints' / 'step3'}",
        "train.export=false",
        "eval.prompts=[]",
        ranks=2,
    )
    assert resumed.ok, resumed.explain()
    assert "dist.sequence_parallel_size: 2 in the checkpoint, 1 now" in resumed.proc.stdout + resumed.proc.stderr
    assert [r["step"] for r in resumed.records("train")] == [4, 5, 6]
    assert_within(resumed.losses, sp_losses[3:])
    assert_within([r["grad_norm"] for r in resumed.records("train")], sp_norms[3:])


# ------------------------------------------------------------------------------------------- a real pretrained model
LONG = 2304  # tokens per row: 2k+, a multiple of N=3 (768 per rank)


def long_rows(n: int, offset: int = 0) -> str:
    """Rows whose answers run past LONG tokens (data.max_seq_len cuts them there)."""
    colors = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
    rows = []
    for i in range(offset, offset + n):
        answer = " ".join(f"Item {j} of list {i} is {colors[(i * 7 + j) % len(colors)]}." for j in range(500))
        rows.append(json.dumps({"prompt": f"Describe list {i}.", "chosen": answer}))
    return "\n".join(rows) + "\n"


@pytest.mark.slow
def test_smollm2_at_n3_on_three_ranks_trains_2k_rows_at_zero3_and_its_export_reloads(
    tmp_path, smollm2_6_layers_dir, cache_dir, compose_cfg
):
    """SmolLM2-135M's first 6 layers (the head split and the tokenizer are the model's; depth changes nothing
    here): 9 attention heads and 3 key/value heads over N=3 ranks (3 and 1 each), ZeRO-3, fp32, rows of 2304
    tokens. The export reloads with transformers, and its loss on the eval row, computed here without any
    sharding, is the run's final eval loss."""
    from transformers import AutoModelForCausalLM

    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.tokenizer import load_tokenizer
    from tests.training import launch

    (tmp_path / "train.jsonl").write_text(long_rows(4))
    (tmp_path / "eval.jsonl").write_text(long_rows(1, offset=100))
    overrides = [
        "model=local",
        f"model.name_or_path={smollm2_6_layers_dir}",
        "data=local",
        f"data.sources.0.path={tmp_path / 'train.jsonl'}",
        f"data.sources.0.eval_path={tmp_path / 'eval.jsonl'}",
        f"data.max_seq_len={LONG}",
        "dist.sequence_parallel_size=3",
        "zero=stage3",
        "train.micro_batch_size=1",
        "train.max_steps=1",  # one update: the final evaluation and the export are of trained weights
        "train.log_every=1",
        "train.eval_at_start=false",
        "train.save_final_checkpoint=false",
        "train.export_dtype=fp32",  # the engine's own weights: the loss check below is then exact
        "optimizer.lr=1e-4",
    ]
    run = launch(tmp_path / "run", *overrides, launcher="ranks", nproc=3, cache_dir=cache_dir, timeout=1500)
    assert run.ok, run.explain()
    summary = run.summary
    assert (summary["world_size"], summary["data_parallel_size"], summary["sequence_parallel_size"]) == (3, 1, 3)
    assert summary["zero_stage"] == 3 and summary["steps"] == 1
    (train,) = run.records("train")
    assert train["loss"] > 0 and train["grad_norm"] > 0
    (final,) = run.records("eval")

    export = run.run_dir / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    cfg = compose_cfg(*overrides, f"data.cache_dir={cache_dir}")  # the run's data, from the cache it built
    data = prepare_sft_data(cfg.data, load_tokenizer(cfg.model, cfg.data), seed=cfg.train.seed)
    row = data.eval[0]
    assert len(row["input_ids"]) == LONG  # 2k+ tokens, cut at data.max_seq_len
    ids = torch.tensor([row["input_ids"]])
    labels = torch.tensor([row["labels"]])
    with torch.no_grad():
        summed, count = token_loss_sum(model(input_ids=ids).logits, labels)
    assert float(count) == final["eval_tokens"]
    loss = float(summed) / float(count)
    print(f"export's loss without sharding {loss!r}, the run's final eval loss at N=3 {final['eval_loss']!r}")
    assert loss == pytest.approx(final["eval_loss"], rel=1e-4)


def test_a_layout_change_under_sequence_parallelism_is_refused_with_the_reason():
    """Measured: DeepSpeed 0.19.8's ds_to_universal rejects a checkpoint written under N=2 ("model-state file count 1
    does not match pp_degree=1 * tp_degree=2") and its universal loader fails under an N=2 mpu; the same world size
    loads directly under any N (test_sp2_at_zero3_with_lora_equals_one_rank_and_resumes_with_n_changed)."""
    from ds_exp.resume.settings import universal_problem

    offload = {"optimizer": "none", "param": "none"}
    sp2 = {"world_size": 2, "zero_stage": 2, "offload": offload, "sequence_parallel_size": 2}
    problem = universal_problem(sp2, {**sp2, "world_size": 1, "sequence_parallel_size": 1})
    assert problem and "world_size: 2 in the checkpoint, 1 now" in problem and "Resume on 2 rank(s)" in problem
    assert universal_problem({**sp2, "sequence_parallel_size": 1}, {**sp2, "world_size": 4}) is not None  # into SP
    assert universal_problem(sp2, {**sp2, "sequence_parallel_size": 1}) is None  # same world: loaded as it is
    plain = {**sp2, "sequence_parallel_size": 1}
    assert universal_problem(plain, {**plain, "world_size": 1}) is None  # no SP: the universal path as before
