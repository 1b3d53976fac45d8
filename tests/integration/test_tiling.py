"""Long-context knobs (ds_exp/long_context/): each one on gives the losses of the run with it off, and does what it is
for (the full logits never exist, MLP intermediates exist one tile at a time, checkpointed layer inputs go through
the offload); at ZeRO-3 on 2 ranks with every knob on, a real run follows the plain run's losses step by step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_exp.model.build import build_model
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.train.step import batch_loss
from tests.training import FAST, assert_close, launch

ROWS, LENGTH = 2, 45  # one row padded after 33 tokens; the first 7 tokens of each row are prompt


def batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (ROWS, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 33:] = 0
    labels = ids.clone()
    labels[:, :7] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Shapes(TorchDispatchMode):
    """Every tensor an op produced, by shape."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def train(compose_cfg, *overrides: str, steps: int = 3) -> tuple[list[float], Shapes, object]:
    """`steps` AdamW steps of the tiny model built as ds_exp builds it (fp32), then one eval loss; the shapes of
    every tensor the first step made."""
    # micro batch and max_seq_len as the batches: chunk counts come from them
    cfg = compose_cfg("precision=fp32", f"train.micro_batch_size={ROWS}", f"data.max_seq_len={LENGTH}", *overrides)
    built = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}})
    model = built.model
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, shapes = [], Shapes()
    for step in range(steps):
        with shapes if step == 0 else contextlib.nullcontext():  # the first step's tensors
            summed, count = batch_loss(built.loss, model, batch(step))
            (summed / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(summed.detach() / count))
    model.eval()
    with torch.no_grad():
        summed, count = batch_loss(built.loss, model, batch(99))
    return [*losses, float(summed / count)], shapes, built


_REFERENCE: list[tuple[list[float], Shapes, object]] = []


@pytest.fixture
def reference(compose_cfg):
    """The run with every knob off (built once for the module's tests)."""
    if not _REFERENCE:
        _REFERENCE.append(train(compose_cfg))
    return _REFERENCE[0]


def test_tiled_loss_equals_full_logits_and_never_holds_them(compose_cfg, reference):
    losses, shapes, built = train(compose_cfg, "model.tiled_loss=true", "model.tiled_loss_tokens=13")
    assert_close(losses, reference[0], rel=1e-5)
    vocab = built.config.vocab_size
    full = [s for s in reference[1].shapes if s[-1:] == (vocab,) and s[:-1] in ((ROWS, LENGTH), (ROWS * LENGTH,))]
    assert full, "the reference computes full logits"
    hidden = built.config.hidden_size
    widest = max((s for s in shapes.shapes if s[-1:] == (vocab,) and s[0] != hidden), key=lambda s: s[0])
    assert widest == (13, vocab)  # 90 tokens in 7 chunks of at most 13


def test_tiled_mlp_equals_the_plain_mlp_and_holds_one_tile(compose_cfg, reference):
    losses, shapes, built = train(compose_cfg, "model.tiled_mlp=true", "model.tiled_mlp_shards=4")
    assert_close(losses, reference[0], rel=1e-5)
    intermediate = built.config.intermediate_size
    assert (ROWS, LENGTH, intermediate) in reference[1].shapes
    tiles = {s[1] for s in shapes.shapes if len(s) == 3 and s[2] == intermediate}
    assert tiles == {12, 11}  # 45 tokens in exactly 4 tiles (tensor_split: 12, 11, 11, 11)


def test_activation_offload_saves_each_layer_input_through_save_on_cpu(compose_cfg, reference, monkeypatch):
    packed: list[tuple[int, ...]] = []

    class Counting(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def counting_pack(tensor: torch.Tensor):
                packed.append(tuple(tensor.shape))
                return pack(tensor)

            self.pack_hook = counting_pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    losses, _, built = train(compose_cfg, "model.gradient_checkpointing=true", "model.activation_offload=true")
    assert_close(losses, reference[0], rel=1e-5)
    layers, hidden = built.config.num_hidden_layers, built.config.hidden_size
    # what each checkpointed layer keeps (its input), in each of the 3 steps (the final norm's input comes on top)
    assert packed.count((ROWS, LENGTH, hidden)) >= 3 * layers


def test_every_knob_at_once_with_lora_on_the_output_embeddings(compose_cfg):
    lora = ("lora.dim=4", "lora.module_name=e")  # every Linear layer, lm_head too
    plain, _, plain_built = train(compose_cfg, *lora)
    tiled, _, built = train(
        compose_cfg,
        *lora,
        "model.gradient_checkpointing=true",
        "model.activation_offload=true",
        "model.tiled_mlp=true",
        "model.tiled_mlp_shards=3",
        "model.tiled_loss=true",
        "model.tiled_loss_tokens=7",
    )
    assert "lm_head" in built.lora.targets
    assert_close(tiled, plain, rel=1e-5)
    # generation asks for logits (no tiled loss then) one token at a time (3 tiles, 2 of them empty)
    prompt = batch(7)["input_ids"][:1, :5]
    with torch.no_grad():
        said = [b.model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False) for b in (plain_built, built)]
    assert said[0].tolist() == said[1].tolist()


def test_an_mlp_runs_exactly_its_tiles_whatever_the_length():
    """The tile count is the config's on every rank: shorter rows give smaller (even empty) tiles, never fewer
    (ZeRO-3 gathers the MLP's weights per tile; torch.chunk(9 tokens, 4) would give 3)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from ds_exp.long_context.tiling import tile_mlps

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.silu(self.up(x)))

    class Layer(GradientCheckpointingLayer):  # a decoder layer as transformers marks them
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP()

    model = torch.nn.Sequential(Layer())
    calls: list[int] = []
    model[0].mlp.up.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2]))
    plain = MLP()
    plain.load_state_dict(model[0].mlp.state_dict())
    assert tile_mlps(model, 4, "toy") == 1
    for length, tiles in ((9, [3, 2, 2, 2]), (3, [1, 1, 1, 0])):
        calls.clear()
        x = torch.randn(2, length, 4, requires_grad=True)
        out = model[0].mlp(x)
        torch.testing.assert_close(out, plain(x))
        out.sum().backward()
        assert calls == tiles + tiles[::-1]  # 4 tiles forward, the same 4 recomputed in backward (last first)


@pytest.mark.slow
def test_zero3_on_two_ranks_with_every_knob_follows_the_plain_run(tmp_path, cache_dir):
    """Rows of different lengths on the two ranks, tiles beyond the shortest rows and every parameter gathered
    (persistence threshold 0): a rank that ran fewer tiles than the other would hang the ZeRO-3 gathers."""
    common = (
        *FAST,
        "zero=stage3",
        "zero.stage3_param_persistence_threshold=0",
        "train.gradient_accumulation_steps=2",
        "train.micro_batch_size=2",
        "train.eval_at_start=true",
    )
    knobs = (
        "model.gradient_checkpointing=true",
        "model.activation_offload=true",
        "model.tiled_mlp=true",
        "model.tiled_mlp_shards=12",
        "model.tiled_loss=true",
        "model.tiled_loss_tokens=16",
    )
    plain = launch(tmp_path / "plain", *common, launcher="ranks", nproc=2, cache_dir=cache_dir, timeout=300)
    tiled = launch(tmp_path / "tiled", *common, *knobs, launcher="ranks", nproc=2, cache_dir=cache_dir, timeout=300)
    assert plain.ok, plain.explain()
    assert tiled.ok, tiled.explain()
    assert_close(tiled.losses, plain.losses, rel=1e-5)
    for key in ("initial_eval", "final_eval"):
        assert tiled.summary[key]["eval_loss"] == pytest.approx(plain.summary[key]["eval_loss"], rel=1e-5)
    assert "MLP tiles 12, loss chunks" in (tiled.run_dir / "logs" / "rank0.log").read_text()


def test_long_context_settings_are_checked_before_the_run(compose_cfg, tmp_path):
    from ds_exp.core.errors import ConfigError
    from ds_exp.launch.validation import validate

    def problems(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as info:
            validate(compose_cfg(*overrides), accelerator="cpu")
        return info.value.problems

    # values first: a combination is judged once every value holds
    assert problems("model.activation_offload=true", "model.tiled_mlp_shards=0", "model.tiled_loss_tokens=-1") == [
        "model.tiled_mlp_shards=0: must be >= 1, or null to derive it",
        "model.tiled_loss_tokens=-1: must be >= 1, or null to derive it",
    ]
    assert problems("model.activation_offload=true") == [
        "model.activation_offload=true keeps what activation checkpointing saves (each layer's input) in host "
        "memory, and checkpointing is off: add model.gradient_checkpointing=true",
    ]
    assert problems("model.tiled_loss=true", "+model.arch.final_logit_softcapping=30.0") == [
        "model.tiled_loss=true: this model changes its logits after lm_head (final_logit_softcapping=30.0), which a "
        "loss computed in chunks of lm_head's output would skip; set model.tiled_loss=false"
    ]
    assert problems("model.rope_scaling={factor:4.0}") == [
        "model.rope_scaling={factor:4.0}: name the scaling with rope_type (one of linear, dynamic, yarn, longrope, "
        "llama3, default), e.g. rope_type:yarn"
    ]
    assert problems("model.rope_scaling={rope_type:ntk}")[0].endswith(
        "rope_type=ntk is not one of linear, dynamic, yarn, longrope, llama3, default"
    )
    assert problems("model.rope_scaling={rope_type:yarn}") == [
        "model.rope_scaling={rope_type:yarn}: rope_type=yarn needs factor >= 1 (new context / trained context), "
        "e.g. factor:4.0"
    ]
    gpt2 = ("model.arch.model_type=gpt2", "~model.arch.max_position_embeddings", "+model.arch.n_positions=64")
    assert problems(*gpt2, "data.max_seq_len=64", "model.rope_scaling={rope_type:linear,factor:2}") == [
        "model.rope_scaling={rope_type:linear,factor:2}: the gpt2 model learned a table of absolute positions, it "
        "has no rotary embeddings to scale; remove model.rope_scaling"
    ]
    every = ("model.gradient_checkpointing=true", "model.activation_offload=true", "model.tiled_mlp=true")
    validate(compose_cfg(*every, "model.tiled_loss=true", "model.rope_scaling={rope_type:yarn,factor:4}"), "cpu")


def test_rope_scaling_reaches_the_model_config(compose_cfg):
    from ds_exp.core.errors import ConfigError
    from ds_exp.model.architecture import build_model_config

    cfg = compose_cfg("model.rope_scaling={rope_type:yarn,factor:4.0,original_max_position_embeddings:512}")
    config = build_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data))
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 10000.0,  # the model's own, kept
    }
    broken = compose_cfg("model.rope_scaling={rope_type:llama3,factor:8.0}")  # llama3 needs more keys
    with pytest.raises(ConfigError, match=r"model.rope_scaling=\{rope_type:llama3,factor:8.0\}: Missing required keys"):
        build_model_config(broken.model, load_tokenizer(broken.model, broken.data))


def test_the_planner_counts_length_sequence_parallelism_and_each_knob(compose_cfg, tmp_path):
    from ds_exp.config.memory_plan import LongContext, ModelShape, estimate_activations
    from ds_exp.tools.dry_run import make_plan

    llama8b = ModelShape(hidden=4096, intermediate=14336, layers=32, vocab=128256, heads=32, kv_heads=8)

    def gib(length: int, **knobs) -> float:
        return (
            estimate_activations(
                micro_batch=1, seq_len=length, shape=llama8b, precision="bf16", knobs=LongContext(**knobs)
            )
            / 2**30
        )

    assert gib(65536) == pytest.approx(2 * gib(32768), rel=1e-6)  # linear in length: no scores with SDPA
    assert gib(32768, attention_scores=True) > 2 * gib(32768)  # eager keeps heads x length^2
    steps = [
        {},
        {"loss_chunk_tokens": 2048},
        {"loss_chunk_tokens": 2048, "mlp_tiles": 8},
        {"loss_chunk_tokens": 2048, "mlp_tiles": 8, "checkpointing": True},
        {"loss_chunk_tokens": 2048, "mlp_tiles": 8, "checkpointing": True, "offload": True},
    ]
    sizes = [gib(131072, **knobs) for knobs in steps]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)  # each knob saves
    every = steps[-1]
    assert gib(131072, sequence_parallel=2, **every) < 0.7 * gib(131072, **every)  # half the tokens per rank
    on_cpu = estimate_activations(
        micro_batch=1, seq_len=131072, shape=llama8b, precision="bf16", knobs=LongContext(**every), accelerator="cpu"
    )
    assert on_cpu / 2**30 == pytest.approx(gib(131072, **steps[-2]))  # offload saves nothing where host = device

    # a trained input embedding's gradient at the end of backward: the peak of a short checkpointed run of a real
    # vocabulary (SmolLM2-135M's shape, tied, 256 tokens, fp32: 324.1 MiB measured by bench.long_context --growth)
    smol = ModelShape(hidden=576, intermediate=1536, layers=30, vocab=49152, heads=9, kv_heads=3, tied=True)

    def smol_bytes(**kwargs) -> float:
        knobs = LongContext(checkpointing=True)
        return estimate_activations(micro_batch=1, seq_len=256, shape=smol, precision="fp32", knobs=knobs, **kwargs)

    assert smol_bytes(embedding_trains=True) / 2**20 == pytest.approx(324.1, rel=0.05)
    assert smol_bytes(embedding_trains=False) / 2**20 < 200  # LoRA: the embedding is frozen
    untied = ModelShape(hidden=576, intermediate=1536, layers=30, vocab=49152, heads=9, kv_heads=3, tied=False)
    knobs = LongContext(checkpointing=True)
    two = estimate_activations(
        micro_batch=1, seq_len=256, shape=untied, precision="fp32", knobs=knobs, embedding_trains=True
    )
    assert two < smol_bytes(embedding_trains=True)

    # the dry run counts them, and experiment=long_context turns them on
    long = compose_cfg("experiment=long_context", "data.max_seq_len=4096")
    assert (long.model.tiled_mlp, long.model.tiled_loss, long.model.gradient_checkpointing) == (True, True, True)
    assert long.model.activation_offload and long.train.micro_batch_size == 1 and long.zero.stage == 3
    plain = compose_cfg("zero=stage3", "data.max_seq_len=4096", "train.micro_batch_size=1")
    plans = [make_plan(cfg, tmp_path / name) for name, cfg in (("long", long), ("plain", plain))]
    activations = [plan["memory_per_rank"]["activation_bytes"] for plan in plans]
    assert 0 < activations[0] < activations[1] / 2
    assert all(p["estimate_per_rank_bytes"] > p["memory_per_rank"]["activation_bytes"] for p in plans)


@pytest.mark.slow
def test_autotune_sweeps_the_knobs_and_its_estimate_counts_them(tmp_path):
    """A grid over the tiling knobs at a long length: the estimate (model states + activations at
    data.max_seq_len) ranks every knob combination below the plain one; with a budget nothing meets, the refusal
    names the cheapest, all knobs on, and launches nothing."""
    from tests.conftest import run_cli

    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "experiment=autotune",
        "~hydra.sweeper.params",
        "data.max_seq_len=65536",
        "train.micro_batch_size=1",
        "model.gradient_checkpointing=false,true",
        "model.tiled_loss=false,true",
        "model.tiled_loss_tokens=4096",  # the auto chunk of this small vocabulary would hold every token
        "model.tiled_mlp=false,true",
        "hydra.sweeper.memory_budget=64MiB",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "nothing fits the memory budget of 64.00 MiB per rank" in proc.stderr
    cheapest = "gradient_checkpointing=True model.tiled_loss=True model.tiled_loss_tokens=4096 model.tiled_mlp=True]"
    assert f"{cheapest}, needs an estimated" in proc.stderr
    assert not sweep.exists()
