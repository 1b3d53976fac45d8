"""The recipe's pieces one at a time, in this process: the step (its loss scaling and votes), the metric window
(its sums, the line it writes, what a checkpoint carries) and the run state behind summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ds_exp.artifacts.summary import RunState, write_summary
from ds_exp.model.engine import build_metric_scheduler
from ds_exp.train.flops import FlopsModel
from ds_exp.train.metrics import Metrics
from ds_exp.train.step import IGNORE_INDEX, StepResult, StepVotes, TrainStep, token_loss_sum


@pytest.fixture
def one_rank(tmp_path):
    """A real gloo process group of one rank (the step and the metrics make real collectives)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeEngine:
    """Logits from a fixed linear map, and a record of what the step asked of the engine."""

    device = torch.device("cpu")

    def __init__(self, vocab: int = 16, applied: bool = True) -> None:
        torch.manual_seed(0)
        self.table = torch.randn(32, vocab, requires_grad=True)
        self.backward_losses: list[float] = []
        self.steps = 0
        self.applied = applied

    def __call__(self, input_ids, attention_mask=None, use_cache=False, **_):
        return SimpleNamespace(logits=self.table[input_ids])

    def backward(self, loss):
        self.backward_losses.append(float(loss.detach()))
        loss.backward()

    def step(self):
        self.steps += 1

    def was_step_applied(self) -> bool:
        return self.applied


def batch(ids: list[list[int]], prompt: int) -> dict:
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[:, :prompt] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def test_the_step_divides_by_the_global_batchs_label_tokens(one_rank):
    engine = FakeEngine()
    step = TrainStep(engine, world_size=1, flops=FlopsModel(10, 10, 1, 2))
    micro = [batch([[1, 2, 3, 4]], prompt=2), batch([[5, 6, 7, 8], [9, 10, 11, 12]], prompt=1)]
    result = step(micro, stop_requested=True, previous_loss=torch.tensor(float("nan")))
    sums = [token_loss_sum(engine.table[b["input_ids"]], b["labels"]) for b in micro]
    labels = sum(int(count) for _, count in sums)
    assert labels == result.label_tokens == 2 + 3 + 3  # next-token labels: each position after the prompt
    votes = result.votes
    assert (votes.global_label_tokens, votes.stop, votes.non_finite) == (8.0, 1.0, 1.0)
    assert math.isnan(votes.previous_loss_sum)
    # each micro batch's backward: its summed loss x (world x micro batches) / the global label tokens, which
    # DeepSpeed's mean over the 2 micro batches turns into sum / 8
    for (summed, _), seen in zip(sums, engine.backward_losses, strict=True):
        assert seen == pytest.approx(float(summed) * 2 / 8)
    assert float(result.loss_sum) == pytest.approx(sum(float(s) for s, _ in sums))
    assert (result.input_tokens, result.samples, engine.steps, result.applied) == (12.0, 3, 2, True)
    assert result.flops == pytest.approx((4 * 10 + 2 * 10) * 12 + 12 * 1 * 2 * (16 + 16 + 16))
    # the next step's one all-reduce brings this step's loss sum over ranks: its loss for the progress bar
    after = step(micro, stop_requested=False, previous_loss=result.loss_sum)
    assert after.votes.previous_loss_sum == pytest.approx(float(result.loss_sum)) and after.votes.non_finite == 0


def test_a_step_without_label_tokens_stops_the_run(one_rank):
    step = TrainStep(FakeEngine(), world_size=1, flops=FlopsModel(1, 1, 1, 1))
    with pytest.raises(Exception, match="holds no label tokens"):
        step([batch([[1, 2, 3]], prompt=3)], stop_requested=False, previous_loss=None)


class Sink:
    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.run_id = None

    def write(self, record: dict) -> None:
        self.lines.append(json.loads(json.dumps(record)))

    def log(self, values: dict, step: int) -> None:
        self.lines.append({"step": step, **values})


def result(loss: float, labels: int, tokens: float, applied: bool = True) -> StepResult:
    votes = StepVotes(labels, 0, 0)
    return StepResult(votes, torch.tensor(loss), labels, tokens, 2, 1e9, applied)


def test_a_metric_window_writes_exact_sums_and_carries_the_open_one(one_rank):
    jsonl, wandb = Sink(), Sink()
    metrics = Metrics(jsonl, wandb, device=torch.device("cpu"), world_size=1, peak_flops=1e10, carried=(3.0, 2.0))
    metrics.add(result(6.0, 4, 10), seconds=0.5)
    metrics.add(result(1.0, 4, 30, applied=False), seconds=0.5)
    metrics.close({"step": 2, "epoch": 0.5, "lr": 1e-3, "grad_norm": None, "peak_memory_bytes": 1, "loss_scale": None})
    assert jsonl.lines == []  # written once the sums over ranks are in: at the next step, or before anything else
    metrics.write()
    (line,) = jsonl.lines
    assert line["loss"] == pytest.approx((3 + 6 + 1) / (2 + 4 + 4))  # a resumed window's sums count once
    assert line["skipped_steps"] == 1 and line["step"] == 2
    assert line["tokens_per_s"] == pytest.approx(40 / line["step_time_s"] / 2, rel=0.05)
    assert line["mfu"] == pytest.approx(line["tflops_per_device"] * 1e12 / 1e10)
    assert wandb.lines[0]["train/loss"] == line["loss"]
    metrics.add(result(2.0, 5, 10), seconds=0.1)
    assert metrics.carry() == (pytest.approx(2.0), 5.0)  # the open window, for a checkpoint
    totals = metrics.totals
    assert (totals.tokens, totals.seconds, totals.skipped_steps, totals.last_loss) == (40, 1.1, 1, line["loss"])


def test_the_summary_comes_from_the_run_state(tmp_path):
    from ds_exp.config.secrets import register_secrets

    register_secrets({"api_key": "sk-abcdefgh"})
    state = RunState(tmp_path, "single", world_size=2, peak_flops=1e12)
    state.train_seconds, state.train_tokens, state.train_flops = 10.0, 5000.0, 4e12
    state.status, state.error, state.steps = "failed", "RunFailed: the key sk-abcdefgh was refused", 7
    summary = write_summary(state, peaks=[100, None])
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert summary["tokens_per_s"] == 500.0 and summary["tokens_per_s_per_device"] == 250.0
    assert summary["mfu"] == pytest.approx(4e12 / 10 / (1e12 * 2))
    assert summary["steps"] == 7 and summary["peak_memory_bytes_per_rank"] == [100, None]
    assert "sk-abcdefgh" not in (tmp_path / "summary.json").read_text()
    before = RunState(Path("/nowhere"), "single", world_size=1).as_summary([0])
    assert before["steps"] is None and before["tokens_per_s"] is None and before["mfu"] is None
    assert math.isfinite(before["wall_time_s"])


@pytest.mark.slow  # imports transformers' model code
def test_an_export_that_fills_the_disk_leaves_nothing_half_written(mount_tmpfs, compose_cfg):
    """The export's writer on a disk too small for the weights (about 2 MB): one message with the room needed, no
    .hf_model.tmp left, and an earlier export in its place untouched."""
    from transformers import AutoModelForCausalLM

    from ds_exp.core.errors import RunFailed
    from ds_exp.exports.writer import ExportSpec, write_export
    from ds_exp.model.architecture import build_model_config
    from ds_exp.model.tokenizer import load_tokenizer, tokenizer_source

    cfg = compose_cfg()
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    config = build_model_config(cfg.model, tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    spec = ExportSpec(
        config, None, "float32", config.vocab_size, len(tokenizer), tokenizer_source(cfg.model), None, "fp32", "auto"
    )
    disk = mount_tmpfs("1m")
    earlier = disk / "hf_model"
    earlier.mkdir()
    (earlier / "ds_exp_export.json").write_text("{}")  # an earlier export: replaced only by a complete one
    with pytest.raises(RunFailed) as info:
        write_export(model.state_dict(), set(), spec, tokenizer, earlier)
    message = str(info.value)
    assert message.startswith(f"could not write the export {earlier} (")
    assert "the weights alone need about 1.88 MiB" in message and "resume=auto" in message
    assert sorted(p.name for p in disk.iterdir()) == ["hf_model"]  # no .hf_model.tmp
    assert [p.name for p in earlier.iterdir()] == ["ds_exp_export.json"]


def test_a_marker_that_is_not_a_json_object_means_an_incomplete_checkpoint(tmp_path):
    from ds_exp.core.errors import ResumeError
    from ds_exp.resume.store import COMPLETE_MARKER, complete_checkpoints, find_resume_checkpoint, is_complete

    checkpoints = tmp_path / "checkpoints"
    markers = {"step2": '{"step": 2}', "step4": "", "step6": "[1]", "step8": '{"step": 8', "step10": "{}"}
    for tag, text in markers.items():
        (checkpoints / tag).mkdir(parents=True)
        (checkpoints / tag / COMPLETE_MARKER).write_text(text)
    assert complete_checkpoints(checkpoints) == [checkpoints / "step2"]
    assert [tag for tag in markers if is_complete(checkpoints / tag)] == ["step2"]
    assert find_resume_checkpoint("auto", tmp_path, "checkpoints") == checkpoints / "step2"
    with pytest.raises(ResumeError) as info:  # named directly: said so, with the one to use instead
        find_resume_checkpoint(str(checkpoints / "step4"), tmp_path, "checkpoints")
    message = str(info.value)
    assert message.startswith(f"resume={checkpoints / 'step4'}: ")
    assert f"its {COMPLETE_MARKER} is empty or unreadable" in message and "not a complete checkpoint" in message
    assert f"the newest complete checkpoint beside it is {checkpoints / 'step2'}" in message


def test_a_submitit_job_without_resume_continues_its_own_directory():
    """The one resume rule (resume_plan before the engine, resume after it): SLURM requeues a submitit job into the
    same directory, so unset means auto there; every other launcher takes `resume` as given."""
    from ds_exp.resume.store import resume_wanted

    assert resume_wanted(None, "submitit") == "auto"
    assert [resume_wanted(None, launcher) for launcher in ("single", "env", "mpi", "slurm")] == [None] * 4
    assert resume_wanted("/runs/a/checkpoints/step4", "submitit") == "/runs/a/checkpoints/step4"
    assert resume_wanted("auto", "single") == "auto"


def test_the_disk_check_counts_only_what_the_run_will_still_write(one_rank, mount_tmpfs, compose_cfg):
    """A 4 MiB disk: a checkpoint of 8 MiB does not fit, the export of 2 MiB does. A run from step 0, or a resume
    with steps left, needs both; a resume from a checkpoint at the last step needs only the export; a run complete
    already needs nothing; with no checkpoint ahead (train.save_every past the end) only the export counts."""
    from ds_exp.config.features import feature_hooks, feature_settings
    from ds_exp.core.errors import RunFailed
    from ds_exp.train.disk_space import check_disk_space, saves_a_checkpoint
    from ds_exp.train.hooks import RunHooks

    disk = mount_tmpfs("4m")
    session = SimpleNamespace(is_main=True, run_dir=disk / "run", precision="fp32")
    cfg = compose_cfg("train.save_every=3", "precision=fp32")
    mib = 2**20
    hooks = RunHooks(feature_hooks(feature_settings(cfg)))

    def check(start: int, total: int = 8) -> None:
        check_disk_space(
            cfg.train, hooks, session, 8 * mib, mib // 2, start_step=start, total_steps=total
        )  # export: 2 MiB

    for start in (0, 5):
        with pytest.raises(RunFailed) as info:
            check(start)
        assert "one checkpoint and the export need about 10.00 MiB" in str(info.value)
    check(8)  # the final checkpoint is there: only the export is left to write
    cfg.train.save_final_checkpoint = False
    check(7)  # no multiple of save_every=3 left up to step 8, and no final checkpoint
    assert saves_a_checkpoint(cfg.train, 5, 8) and not saves_a_checkpoint(cfg.train, 6, 8)
    session.run_dir.mkdir()
    (session.run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 8}))
    (disk / "filler").write_bytes(b"\0" * (3 * mib))
    check(8)  # complete already: nothing is written at all
    with pytest.raises(RunFailed) as info:
        check(7)
    assert "KiB free, the export needs about 2.00 MiB" in str(info.value)


def test_a_lora_run_plans_checkpoints_of_what_trains_and_exports_of_its_adapter(compose_cfg):
    """Issue 35 §4 (a LoRA run of SmolLM2-135M took 1.6 GB): a checkpoint holds what trains (weights, fp32 master and
    two Adam moments), never the frozen base; every export writes the adapter (fp32) and the merged model only where
    train.export_merged asks for it: by default in the final export alone. Without LoRA an export is the model."""
    from ds_exp.config.memory_plan import checkpoint_bytes
    from ds_exp.exports.on_disk import one_export_bytes

    parameters, trainable = 134_515_008, 921_600  # SmolLM2-135M, rank 8 on its attention
    assert checkpoint_bytes(trainable, "bf16") == trainable * (2 + 12) < 13 * 2**20
    sizes = {}
    for merged in ("end", "every", "none"):
        cfg = compose_cfg("lora.dim=8", f"train.export_merged={merged}")
        sizes[merged] = [
            one_export_bytes(cfg.train, cfg.lora.dim, parameters, trainable, "bf16", final=f) for f in (True, False)
        ]
    model, adapter = parameters * 2, trainable * 4
    assert sizes == {"end": [model + adapter, adapter], "every": [model + adapter] * 2, "none": [adapter, adapter]}
    full = compose_cfg("train.export_merged=none")  # no LoRA: nothing to leave out
    assert one_export_bytes(full.train, full.lora.dim, parameters, parameters, "bf16", final=False) == model


def _schedule() -> torch.optim.lr_scheduler.LambdaLR:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


@pytest.mark.parametrize("path", ["checkpoint", "universal"])
def test_both_resume_paths_fast_forward_the_schedule_past_fp16s_skipped_steps(path, tmp_path, monkeypatch):
    """A resume at step 10 of an fp16 run whose loss scaler skipped 3 steps: the schedule stepped 7 times, as in the
    run. The universal path used to step it 10 times (its schedule ahead of the run's)."""
    from ds_exp.checkpoint import checkpointer, universal

    scheduler = _schedule()
    engine = SimpleNamespace(lr_scheduler=scheduler, skipped_steps=3)
    saved = {"step": 10}
    if path == "checkpoint":
        engine.load_checkpoint = lambda *a, **k: (str(tmp_path), {"ds_exp": saved})
        monkeypatch.setattr(checkpointer, "load_weights_only", lambda engine: None)
        monkeypatch.setattr(checkpointer, "TrainState", lambda **state: state)
        checkpointer.load_checkpoint(engine, tmp_path / "step10", rank=0)
    else:
        monkeypatch.setattr(universal, "convert", lambda *a, **k: True)
        monkeypatch.setattr(universal, "param_names", lambda *a: [])
        monkeypatch.setattr(universal, "load", lambda engine, tag_dir: {"ds_exp": saved})
        monkeypatch.setattr(universal, "read_marker", lambda tag_dir: {})
        monkeypatch.setattr(universal, "restore_rng", lambda *a, **k: None)
        monkeypatch.setattr(universal.compat, "check_universal_version", lambda: None)
        universal.load_state(engine, tmp_path / "step10", rank=0, world_size=1, seed=0, model=None, groups=[])
    assert scheduler.last_epoch == 7
    assert scheduler.get_last_lr() == [1.0 / 8]


def test_a_one_line_message_quotes_the_first_line_or_the_class():
    from ds_exp.core.errors import first_line

    assert first_line(ValueError("\n  bad value\nmore")) == "bad value"
    assert first_line(KeyError()) == "KeyError"  # str(err).splitlines()[0] raised IndexError here
    assert first_line(OSError("x" * 500)) == "x" * 300


@pytest.mark.parametrize("name", ["reduce_lr_on_plateau", "greedy"])
def test_a_metric_schedule_is_built_and_lowers_the_rate_when_its_metric_stalls(compose_cfg, name):
    """The schedules the loop steps with a metric (eval loss, training loss), outside DeepSpeed's engine."""
    cfg = compose_cfg(f"scheduler={name}", "+scheduler.kwargs.patience=2")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # above GreedyLR's min_lr (1e-3)
    schedule = build_metric_scheduler(cfg.scheduler, optimizer, total_steps=100, warmup_steps=0)
    for _ in range(20):
        schedule.step(1.0)  # never better
    assert optimizer.param_groups[0]["lr"] < 0.1
