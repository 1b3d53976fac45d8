"""The optimizer table (ds_exp/config/optimizers.py): every entry builds a real optimizer on the tiny model as ds_exp
builds it, learns with its YAML's defaults, and keeps the state the memory planner counts; what an entry cannot do is
one line before anything is built; a choice over the optimizer group sweeps and searches like any other."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_exp.config.ds_config import RunFacts, resolve_ds_config
from ds_exp.config.memory_plan import optimizer_state
from ds_exp.config.optimizers import OPTIMIZERS
from ds_exp.core.errors import ConfigError, ResumeError
from ds_exp.launch.validation import validate
from ds_exp.model.engine import parameter_groups
from ds_exp.model.optimizers import build_optimizer
from ds_exp.resume.settings import check_resume
from ds_exp.resume.store import COMPLETE_MARKER
from ds_exp.sweeps.search_space import parse_search_space

VOCAB = 512
RUNS_HERE = [name for name, entry in OPTIMIZERS.items() if not entry.cuda_only and not entry.missing_package("o")]


def tiny_model(cfg) -> LlamaForCausalLM:
    torch.manual_seed(0)
    arch = {k: v for k, v in cfg.model.arch.items() if k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(**arch, vocab_size=VOCAB))


def facts(model: LlamaForCausalLM) -> dict[str, int]:
    config = model.config
    return {"vocab": VOCAB, "hidden": config.hidden_size, "layers": config.num_hidden_layers, "tied": 1}


def deepspeeds_muon(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """What deepspeed.initialize builds for ds_exp's "muon" block at ZeRO stage 0 (its torch_adam: true), without a
    process group: each parameter tagged by DeepSpeed's own set_optimizer_flags, ds_exp's decay groups split into
    a Muon and an AdamW half with the block's settings (the real engine: tests/integration/test_training.py)."""
    import deepspeed
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    opt = cfg.optimizer
    deepspeed.set_optimizer_flags(types.SimpleNamespace(optimizer_name="muon", optimizer_params={}), model)
    halves = []
    for group in parameter_groups(model, opt.weight_decay, list(opt.no_decay)):
        muon = [p for p in group["params"] if p.use_muon]
        adam = [p for p in group["params"] if not p.use_muon]
        wd = group["weight_decay"]
        halves.append(dict(params=muon, use_muon=True, lr=opt.lr, momentum=opt.momentum, weight_decay=wd))
        halves.append(dict(params=adam, use_muon=False, lr=opt.adam_lr, betas=opt.betas, eps=opt.eps, weight_decay=wd))
    groups = [h for h in halves if h["params"]]
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"foreach": None})


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.nbytes for t in tensors)


@pytest.mark.parametrize("name", RUNS_HERE)
def test_every_optimizer_builds_learns_and_keeps_the_state_the_planner_counts(compose_cfg, name):
    """Each entry's real optimizer on the tiny model, with its YAML's defaults (constant rate): the loss on one batch
    falls within a few steps, and the state it keeps after them is the planner's (its entry's state bytes)."""
    cfg = compose_cfg(f"optimizer={name}")
    model = tiny_model(cfg)
    if OPTIMIZERS[name].owners == ("deepspeed",) or cfg.optimizer.owner.value == "deepspeed":
        optimizer = deepspeeds_muon(model, cfg)
    else:
        groups = parameter_groups(model, cfg.optimizer.weight_decay, list(cfg.optimizer.no_decay))
        optimizer = build_optimizer(cfg.optimizer, groups, {}, "cpu")
    batch = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    with torch.compiler.set_stance("force_eager"):  # Muon's torch.compile'd update: minutes of C++ on a CPU
        for _ in range(6):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0], (name, losses)
    trainable = sum(p.numel() for p in model.parameters())
    planned = optimizer_state(cfg.optimizer, cfg.offload, cfg.lora, facts(model), "cpu").bytes(trainable)
    # beside the moments: step counters, Adafactor's factored rows and columns (8 bytes / the hidden size a parameter:
    # 1.3% of 4 bytes here, 0.05% at 4096): under 2% of 4 bytes a parameter
    assert abs(state_bytes(optimizer) - planned) < 0.02 * 4 * trainable, (name, state_bytes(optimizer), planned)


def test_lion_in_torch_is_deepspeeds_cpu_lion():
    """ds_exp's torch Lion (what a CPU accelerator without offload builds) against DeepSpeed's CPU Lion, over a few
    steps with weight decay. It needs that op compiled (about a minute, once): run where it is."""
    from ds_exp.core import compat

    builder = __import__("deepspeed.ops.op_builder", fromlist=["CPULionBuilder"]).CPULionBuilder()
    if not compat.op_prebuilt(builder):
        pytest.skip("DeepSpeed's CPU Lion is not compiled here (python -m bench.optimizers --lion-parity builds it)")
    from deepspeed.ops.lion import DeepSpeedCPULion

    from ds_exp.model.lion import Lion

    torch.manual_seed(0)
    a = torch.randn(64, 32, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours = Lion([a], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    theirs = DeepSpeedCPULion([b], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(5):
        grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _problems(compose_cfg, *overrides: str, accelerator: str = "cpu") -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(compose_cfg(*overrides), accelerator=accelerator)
    return caught.value.problems


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed here")
def test_adamw_8bit_is_one_line_where_bitsandbytes_does_not_run(compose_cfg):
    on_cpu = _problems(compose_cfg, "optimizer=adamw_8bit")
    assert on_cpu == [
        "optimizer=adamw_8bit needs a CUDA GPU and bitsandbytes, and this is cpu (and bitsandbytes is not installed); "
        "use optimizer=adamw, or optimizer=lion for half of AdamW's optimizer memory"
    ]
    on_gpu = _problems(compose_cfg, "optimizer=adamw_8bit", accelerator="cuda")
    assert on_gpu == [
        'optimizer=adamw_8bit needs bitsandbytes, which is not installed: pip install "ds_exp[bitsandbytes]"'
    ]


REFUSED = [
    (("optimizer=adafactor", "zero=stage1"), "optimizer=adafactor at zero.stage=1: Adafactor factors"),
    (("optimizer=sgd", "zero=stage2", "offload=cpu"), "optimizer=sgd with offload.optimizer=cpu: DeepSpeed runs"),
    (
        ("optimizer=muon", "zero=stage2", "offload=cpu", "train.gradient_clipping=0"),
        "optimizer=muon with offload.optimizer=cpu: DeepSpeed's Muon diverges with CPU offload (DeepSpeed RFC #8463)",
    ),
    (("optimizer=muon", "zero=stage1"), "DeepSpeed 0.19.8 clips Muon's orthogonalized update there"),
    (("optimizer=muon", "optimizer.owner=ds_exp"), "optimizer=muon is built by DeepSpeed"),
    (
        ("optimizer=muon", "zero=stage3", "train.gradient_clipping=0", "zero.reduce_scatter=true"),
        "zero.reduce_scatter=true: DeepSpeed's Muon at ZeRO stage 3 does not run with reduce-scatter",
    ),
    (
        ("optimizer=muon", "zero=stage3", "train.gradient_clipping=0", "train.compile=true"),
        "train.compile=true with optimizer=muon on a CPU: ds_exp runs its update eagerly there",
    ),
    (("optimizer=lion", "optimizer.impl=torch_fused"), "optimizer=lion is built as torch, deepspeed_fused"),
    (("optimizer=lion", "optimizer.impl=deepspeed_fused"), "FusedLion runs on CUDA GPUs and this is cpu"),
    (("optimizer=lion", "optimizer.owner=deepspeed"), "DeepSpeed builds its CUDA kernel for it"),
    (("optimizer=adamw", "zero=stage2", "offload=cpu", "optimizer.impl=torch"), "runs on the host with DeepSpeed's"),
    (("optimizer=sgd", "optimizer.nesterov=true", "optimizer.momentum=0"), "optimizer.nesterov=true needs momentum"),
    (("optimizer=adafactor", "optimizer.d=0.5"), "optimizer.d=0.5: must be >= 1 (the clipping threshold"),
    (("optimizer=muon", "optimizer.adam_lr=0"), "optimizer.adam_lr=0.0: must be > 0 (the auxiliary AdamW's learning"),
    (("optimizer=adamw", "optimizer.name=sgd"), "optimizer.name=sgd does not match the optimizer's settings"),
]


@pytest.mark.parametrize(("overrides", "expected"), REFUSED, ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_what_an_optimizer_cannot_do_is_one_line(compose_cfg, overrides, expected):
    problems = _problems(compose_cfg, *overrides)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_deepspeed_config_gets_what_each_optimizer_needs(compose_cfg):
    def ds(*overrides: str) -> dict:
        return resolve_ds_config(compose_cfg(*overrides), RunFacts(precision="fp32"), partial=True)

    assert ds("optimizer=sgd", "zero=stage1")["zero_allow_untested_optimizer"] is True  # torch's SGD under ZeRO
    assert "zero_allow_untested_optimizer" not in ds("optimizer=adamw", "zero=stage1")
    muon = ds("optimizer=muon", "zero=stage3", "train.gradient_clipping=0")
    assert muon["zero_optimization"]["reduce_scatter"] is False
    assert muon["optimizer"] == {
        "type": "muon",
        "params": {
            **{"lr": 0.02, "momentum": 0.95, "ns_method": "gram", "adam_lr": 1e-3, "betas": [0.9, 0.95]},
            **{"eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
        },
    }
    sgd = ds("optimizer=sgd", "optimizer.owner=deepspeed", "optimizer.momentum=0.8")["optimizer"]
    assert sgd == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.8, "nesterov": False, "weight_decay": 0.0}}


def _checkpoint(tmp_path: Path, optimizer: str | None) -> Path:
    tag = tmp_path / "checkpoints" / "step4"
    tag.mkdir(parents=True)
    settings = {"zero_stage": 2, "offload": {"optimizer": "none", "param": "none"}, "world_size": 2}
    if optimizer is not None:
        settings["optimizer"] = optimizer
    (tag / COMPLETE_MARKER).write_text(json.dumps({"step": 4, "settings": settings}))
    return tag


@pytest.mark.parametrize("optimizer", ["lion", "sgd", "muon"])
def test_a_layout_change_is_refused_where_universal_checkpoints_lack_the_optimizers_state(
    compose_cfg, tmp_path, optimizer
):
    cfg = compose_cfg(f"optimizer={optimizer}", "zero=stage2", "train.gradient_clipping=0")
    current = {"zero_stage": 2, "offload": {"optimizer": "none", "param": "none"}, "world_size": 1}
    tag = _checkpoint(tmp_path, optimizer)
    with pytest.raises(ResumeError, match="universal checkpoints cannot carry"):
        check_resume(cfg.resume, tag, {**current, "optimizer": optimizer})
    check_resume(cfg.resume, tag, {**current, "world_size": 2, "optimizer": optimizer})  # the same layout loads


def test_universal_checkpoints_take_adam_and_checkpoints_of_before_and_refuse_another_optimizer(compose_cfg, tmp_path):
    current = {"zero_stage": 2, "offload": {"optimizer": "none", "param": "none"}, "world_size": 1}
    for written_with in ("adamw", None):  # None: a marker of an earlier ds_exp, written with AdamW
        tag = _checkpoint(tmp_path / str(written_with), written_with)
        check_resume(None, tag, {**current, "optimizer": "adamw"})
    with pytest.raises(ResumeError, match=r"optimizer: sgd in the checkpoint, adamw now \(its state belongs"):
        sgd = _checkpoint(tmp_path / "sgd", "sgd")
        check_resume(None, sgd, {**current, "world_size": 2, "optimizer": "adamw"})


def test_the_optimizer_group_is_an_optuna_search_dimension(compose_cfg):
    space = parse_search_space(["optimizer=choice(adamw,lion,sgd)", "optimizer.weight_decay=0.01"])
    assert space.distributions["optimizer"].choices == ("adamw", "lion", "sgd")
    for choice in ("adamw", "lion", "sgd"):
        trial = space.overrides({"optimizer": choice})
        validate(compose_cfg(*trial), accelerator="cpu")  # each trial composes and validates
        assert trial == ["optimizer.weight_decay=0.01", f"optimizer={choice}"]


def test_the_readme_lists_every_optimizer_with_when_to_use_it():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name, entry in OPTIMIZERS.items():
        assert f"| `optimizer={name}` | {entry.when} |" in readme, name


def test_the_universal_command_refuses_a_checkpoint_of_another_optimizer(tmp_path, capsys):
    from ds_exp.checkpoint.universal import main

    tag = _checkpoint(tmp_path, "sgd")
    assert main([str(tag)]) != 0
    said = capsys.readouterr().err
    assert f"{tag} is not converted: the checkpoint holds optimizer=sgd's state" in said, said
    assert not list(tmp_path.rglob("*.universal*")), "nothing written"
