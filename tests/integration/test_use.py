"""Use what you trained: `python -m ds_exp.export` of checkpoints taken mid-run (ZeRO-0, ZeRO-3 on 2 ranks in bf16,
ZeRO-2 with LoRA merged and as an adapter) holds exactly what the run's own export of that step holds; exports
during training and their rotation; `python -m ds_exp.chat` answers as the run's generations did; generation
samples when asked, seeded, without touching training's random state."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.integration.test_harness import task_yaml
from tests.training import FAST, launch, train_here, user_env

PROMPT = "repeat the words: apple cat dog"


def export(*args: str) -> int:
    from ds_exp.exports.cli import export_main

    return export_main([str(a) for a in args])


def same_export(ours: Path, runs: Path, weights: str = "model.safetensors") -> None:
    """Every tensor equal, bit for bit, and the same config and tokenizer."""
    a, b = load_file(ours / weights), load_file(runs / weights)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    if (runs / "config.json").is_file():
        assert json.loads((ours / "config.json").read_text()) == json.loads((runs / "config.json").read_text())
    assert (ours / "tokenizer.json").read_bytes() == (runs / "tokenizer.json").read_bytes()


def chat_args(**given: object) -> argparse.Namespace:
    from ds_exp.exports.cli import chat_parser

    return argparse.Namespace(**{**vars(chat_parser().parse_args(["x"])), **given})


def ask(model_dir: Path, prompts: list[str], **given: object) -> list[str]:
    """python -m ds_exp.chat MODEL_DIR < prompts, in this process."""
    from ds_exp.exports.chat import chat
    from ds_exp.exports.checks import model_dir_of

    out, stdin = io.StringIO(), io.StringIO("\n".join(prompts) + "\n")
    assert chat(model_dir_of(str(model_dir)), chat_args(jsonl=True, **given), stdin=stdin, stdout=out) == 0
    return [json.loads(line)["completion"] for line in out.getvalue().splitlines()]


# ------------------------------------------------------------------------------------------------ fast, in-process


@pytest.mark.slow  # imports transformers' model code
def test_sampling_is_seeded_and_leaves_trainings_random_state_alone(compose_cfg, tmp_path):
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer
    from ds_exp.train.generate import Sampling, generate

    cfg = compose_cfg()
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    model = build_model(cfg, tokenizer, {"zero_optimization": {"stage": 0}}).model

    class Engine:  # what generate() uses of DeepSpeed's engine at stage 0, on rank 0
        module, device = model, torch.device("cpu")

        def zero_optimization_stage(self) -> int:
            return 0

        def eval(self) -> None:
            model.eval()

        def train(self) -> None:
            model.train()

    def complete(sampling: Sampling) -> list[str] | None:
        kwargs = {"template": "dschat", "max_new_tokens": 8, "stop_ids": [], "sampling": sampling}
        return generate(Engine(), tokenizer, [PROMPT], **kwargs)

    with _one_rank(tmp_path):
        torch.manual_seed(0)
        before = torch.get_rng_state()
        hot = Sampling(temperature=1.5, top_p=0.95, top_k=40, seed=7)
        first, again = complete(hot), complete(hot)
        assert torch.equal(torch.get_rng_state(), before)  # what training draws next is what it would have drawn
        assert first == again and first != complete(Sampling(temperature=1.5, top_p=0.95, top_k=40, seed=8))
        greedy = complete(Sampling())
        assert greedy != first and greedy == complete(Sampling(seed=99))  # greedy ignores the seed


@contextlib.contextmanager
def _one_rank(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of one rank, as a run of one rank has."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_step_exports_are_checked_before_training_and_rotation_removes_only_this_runs(compose_cfg, tmp_path):
    from ds_exp.config.features import feature_hooks, feature_settings
    from ds_exp.core.errors import RunFailed
    from ds_exp.exports.on_disk import planned_step_exports, rotated_step_exports
    from ds_exp.train.disk_space import check_disk_space
    from ds_exp.train.hooks import RunHooks

    cfg = compose_cfg("train.export_every=2", "train.export_keep_last=1")
    hooks = RunHooks(feature_hooks(feature_settings(cfg)))
    run_dir = tmp_path / "run"
    assert [p.name for p in planned_step_exports(cfg.train, run_dir, 0, 8)] == [
        "hf_model-step2",
        "hf_model-step4",
        "hf_model-step6",
    ]
    assert [p.name for p in planned_step_exports(cfg.train, run_dir, 5, 8)] == ["hf_model-step6"]
    (run_dir / "hf_model-step4").mkdir(parents=True)
    (run_dir / "hf_model-step4" / "notes.txt").write_text("not ds_exp's")
    session = SimpleNamespace(is_main=True, run_dir=run_dir, precision="fp32")
    with _one_rank(tmp_path):
        with pytest.raises(RunFailed) as info:
            check_disk_space(cfg.train, hooks, session, 1, 1, start_step=0, total_steps=8)
        assert f"train.export_every: {run_dir / 'hf_model-step4'} exists and is not an export" in str(info.value)
        check_disk_space(
            cfg.train, hooks, session, 1, 1, start_step=4, total_steps=8
        )  # step 4 is behind a resume from it

    def made(at: int, **origin: object) -> Path:
        path = tmp_path / "exports" / f"hf_model-step{at}"
        path.mkdir(parents=True)
        (path / "ds_exp_export.json").write_text(json.dumps({"origin": origin}))
        return path

    mine = [made(s, written_by="run", run_id="A", step=s) for s in (2, 4, 6)]
    made(3, written_by="run", run_id="B", step=3)  # another run's, in the same place
    made(5, written_by="python -m ds_exp.export", step=5)  # the user's
    (tmp_path / "exports" / "hf_model-step2_adapter").mkdir()
    (tmp_path / "exports" / "hf_model-step2_adapter" / "adapter_config.json").write_text("{}")
    alone = tmp_path / "exports" / "hf_model-step1_adapter"  # a LoRA step export: the adapter alone (issue 35 §4)
    alone.mkdir()
    (alone / "adapter_config.json").write_text("{}")
    (alone / "ds_exp_export.json").write_text(json.dumps({"origin": {"written_by": "run", "run_id": "A", "step": 1}}))
    doomed = rotated_step_exports(tmp_path / "exports" / "hf_model", "A", keep_last=1)
    assert doomed == [mine[0], mine[1], alone, tmp_path / "exports" / "hf_model-step2_adapter"]
    assert rotated_step_exports(tmp_path / "exports" / "hf_model", "A", keep_last=0) == []


def test_a_conversation_renders_every_turn_as_the_template_trains_it():
    from transformers import AutoTokenizer

    from ds_exp.config.paths import embedded_tokenizer_dir
    from ds_exp.data.templates import render_conversation, render_dschat, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    turns = [("user", "hi"), ("assistant", "hello"), ("user", "copy a b")]
    text, special = render_conversation(turns, "dschat", tokenizer)
    trained, _ = render_dschat(["user", "assistant", "user", "assistant"], ["hi", "hello", "copy a b", "a b"], "<e>")
    assert special and trained.startswith(text) and trained[len(text) :] == " a b<e>"
    assert render_conversation(turns[:1], "dschat", tokenizer) == render_prompt("hi", "dschat", tokenizer)
    assert render_conversation(turns, "raw", tokenizer) == ("hihellocopy a b", True)


# ------------------------------------------------------------------------------------ real runs, mid-run checkpoints


@pytest.fixture(scope="module")
def zero0(tmp_path_factory, cache_dir):
    """ZeRO-0, fp32: checkpoints at 2 and 4, an export every step (the newest 2 kept), generations at 0, 2 and 4
    (a learning rate that leaves the tiny model babbling: an answer of no tokens would prove nothing), and an lm-eval
    task that fails while the final export is scored."""
    root = tmp_path_factory.mktemp("zero0")
    failing = task_yaml(root, "failing", "raise RuntimeError('this document cannot be rendered')")
    run = train_here(
        root / "run",
        *FAST,
        f"eval.harness.tasks=[{failing}]",  # an lm-eval task that fails while it is scored: the run completes
        "optimizer.lr=1e-4",
        "train.max_steps=4",
        "train.save_every=2",
        "train.save_final_checkpoint=true",
        "train.export=true",
        "train.export_every=1",
        "train.export_keep_last=2",
        "train.eval_every=2",
        "eval.every_eval=true",
        f"eval.prompts=[{PROMPT!r}]",
        "eval.max_new_tokens=12",
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    return run


@pytest.mark.slow
def test_exports_during_training_are_rotated_and_say_where_they_come_from(zero0):
    run_dir = zero0.run_dir
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("hf_model"))
    assert kept == ["hf_model", "hf_model-step2", "hf_model-step3"]  # step 1 rotated away; step 4 is hf_model
    origin = json.loads((run_dir / "hf_model-step3" / "ds_exp_export.json").read_text())["origin"]
    assert origin["step"] == 3 and origin["written_by"] == "run" and origin["run_id"]
    meta = json.loads((run_dir / "hf_model" / "ds_exp_export.json").read_text())
    assert meta["origin"]["step"] == 4 and meta["generation"]["template"] == "dschat"
    # the lm-eval evaluation failed (issue 33): its own status, the completed run and its files as they were
    summary = zero0.summary
    assert (summary["status"], summary["harness_status"], summary["harness"]) == ("completed", "failed", None)
    assert "RuntimeError: this document cannot be rendered" in summary["harness_error"]
    assert not (run_dir / "eval").exists() and (run_dir / "checkpoints" / "step4" / "ds_exp_complete.json").is_file()


@pytest.mark.slow
def test_export_of_a_zero0_checkpoint_is_the_runs_own_export_of_that_step(zero0, tmp_path):
    run_dir = zero0.run_dir
    # the command as a user types it: the run directory, its newest checkpoint (the last step) next to it
    proc = subprocess.run(
        [sys.executable, "-m", "ds_exp.export", str(run_dir)], env=user_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert f"exported step 4 to {run_dir / 'hf_model-step4'}" in proc.stdout
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line: what is exported, where; no library output
    same_export(run_dir / "hf_model-step4", run_dir / "hf_model")
    # a checkpoint taken mid-run, into a directory of the user's
    assert export(run_dir / "checkpoints" / "step2", tmp_path / "m2") == 0
    same_export(tmp_path / "m2", run_dir / "hf_model-step2")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m2").state_dict()
    for name, tensor in load_file(tmp_path / "m2" / "model.safetensors").items():
        assert torch.equal(reloaded[name], tensor), name


@pytest.mark.slow
def test_chat_answers_as_the_run_generated(zero0):
    run_dir = zero0.run_dir
    generations = {r["step"]: r["completion"] for r in map(json.loads, (run_dir / "generations.jsonl").open())}
    assert sorted(generations) == [0, 2, 4] and generations[2] and generations[4], generations  # to compare
    # standard input that is not a terminal: one answer per line, greedy by default
    proc = subprocess.run(
        [sys.executable, "-m", "ds_exp.chat", str(run_dir / "hf_model-step2"), "--max-new-tokens", "12"],
        input=f"{PROMPT}\nsort the digits: 3 1 2\n",
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.split("\n")
    assert answers[0] == generations[2] and len(answers) == 3 and answers[2] == "", proc.stdout
    assert ask(run_dir, [PROMPT], max_new_tokens=12) == [generations[4]]  # a run directory: its hf_model
    # sampling with a seed: the same answers every time
    hot = {"temperature": 1.2, "top_k": 50, "seed": 3, "max_new_tokens": 12}
    assert ask(run_dir, [PROMPT, PROMPT], **hot) == ask(run_dir, [PROMPT, PROMPT], **hot)


@pytest.mark.slow
def test_an_empty_answer_gets_one_hint(zero0, tmp_path, capsys):
    """A model that ends every answer at once (its final norm zeroed: every logit 0, so the first token is id 0, the
    end of text), asked raw as issue 35 §1's chat asked: the answers are empty, and stderr says once why they may be
    and what to try."""
    from safetensors.torch import save_file

    from ds_exp.exports.chat import empty_answer_hint

    mute = tmp_path / "mute"
    shutil.copytree(zero0.run_dir / "hf_model-step2", mute)
    weights = load_file(mute / "model.safetensors")
    weights["model.norm.weight"].zero_()
    save_file(weights, mute / "model.safetensors", metadata={"format": "pt"})
    assert ask(mute, [PROMPT, "hello"], max_new_tokens=4, template="raw") == ["", ""]
    err = capsys.readouterr().err
    assert err.count("ds_exp chat: the answer is empty: ") == 1, err  # once, not per answer
    assert "the prompt went to the model as typed (template raw)" in err and "try --template dschat" in err
    assert "(its stop token came first) in the dschat template; try another --template (chat_template, raw)" in (
        empty_answer_hint("dschat")
    )


@pytest.mark.slow
def test_chat_on_a_terminal_is_a_conversation(zero0, monkeypatch, capsys):
    from ds_exp.exports import chat as chat_module

    said: list[list[tuple[str, str]]] = []
    answer = chat_module.Chat.answer

    def recording(self, turns, streamer=None):
        said.append(list(turns))
        return answer(self, turns)

    lines = iter([PROMPT, "and again", "/reset", "hi"])

    def typed(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(chat_module.Chat, "answer", recording)
    monkeypatch.setattr("builtins.input", typed)
    assert chat_module.chat(zero0.run_dir / "hf_model", chat_args(max_new_tokens=4), stdin=Terminal()) == 0
    assert [len(turns) for turns in said] == [1, 3, 1]  # the second turn sees the first answer; /reset forgets
    assert said[1][:2] == [("user", PROMPT), ("assistant", said[1][1][1])] and said[2] == [("user", "hi")]


def _moved_here(run_dir: Path, origin_run_dir: Path) -> None:
    """A copy of a run directory, as if the run had been there: its exports' metadata names it."""
    for meta in run_dir.glob("hf_model*/ds_exp_export.json"):
        found = json.loads(meta.read_text())
        assert Path(found["origin"]["run_dir"]).resolve() == origin_run_dir.resolve()
        meta.write_text(json.dumps({**found, "origin": {**found["origin"], "run_dir": str(run_dir)}}))


@pytest.mark.slow
def test_an_abandoned_branch_takes_its_exports_along_and_its_checkpoints_export_as_trained(zero0, tmp_path, capsys):
    """A resume from step 2 with model.rope_scaling added abandons step 4: its checkpoint and the exports made on
    it (steps 3 and 4) are set aside together, and the set-aside checkpoint exports with the model config it was
    trained with (no rope scaling), the same model as the run's own export of that step. An fp16 export of weights
    beyond fp16's range is refused, nothing written."""
    from omegaconf import OmegaConf

    from ds_exp.exports.on_disk import exports_off_trajectory
    from ds_exp.resume.branches import set_aside_branch
    from ds_exp.resume.store import read_marker

    run = tmp_path / "run"
    shutil.copytree(zero0.run_dir, run, ignore=shutil.ignore_patterns("logs", "*.log"))
    _moved_here(run, zero0.run_dir)
    ckpts = run / "checkpoints"
    assert read_marker(ckpts / "step2")["model_config"]["rope_scaling"] is None  # recorded with the weights
    later = OmegaConf.load(run / ".hydra" / "config.yaml")  # the resume's own config, saved as a resume saves it
    later.model.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    (run / ".hydra" / "resume-2030-01-01_00-00-00").mkdir()
    OmegaConf.save(later, run / ".hydra" / "resume-2030-01-01_00-00-00" / "config.yaml")

    # what the resume from step 2 does before it writes anything (ds_exp.train.recipe.continue_trajectory)
    made_on_it = sorted(p.name for p in run.glob("hf_model*") if p.name != "hf_model-step2")  # (+ step 4's by
    assert {"hf_model", "hf_model-step3"} <= set(made_on_it)  # python -m ds_exp.export, when its test ran first)
    exports = exports_off_trajectory(run / "hf_model", run, 2, same_directory=True)
    aside = set_aside_branch(ckpts, ckpts / "step2", run, exports)
    assert aside.checkpoints == ["step4"] and sorted(aside.exports) == made_on_it
    branch = aside.branch
    assert branch is not None and sorted(p.name for p in (branch / "exports").iterdir()) == made_on_it
    assert sorted(p.name for p in run.glob("hf_model*")) == ["hf_model-step2"]  # on the resumed trajectory
    said = aside.message(ckpts / "step2", run, here=True)
    assert f"step4, {', '.join(aside.exports)} moved (nothing deleted)" in said and "python -m ds_exp.export" in said

    assert export(branch / "step4") == 0  # beside the branch's own exports, not over the trajectory in charge
    same_export(branch / "exports" / "hf_model-step4", branch / "exports" / "hf_model")  # no rope scaling in it
    assert "exported step 4 to" in capsys.readouterr().out

    states_file = ckpts / "step2" / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    name = next(k for k in states["module"] if k.endswith("q_proj.weight"))
    states["module"][name][0, 0] = 7.0e4  # beyond fp16's largest, 65504: inf once cast
    torch.save(states, states_file)
    assert export(ckpts / "step2", tmp_path / "m16", "--dtype", "fp16") == 1
    err = capsys.readouterr().err
    assert f"--dtype=fp16 cannot hold the weights: {name} reaches 70000, beyond float16's largest (65504)" in err
    assert "Traceback" not in err and err.count("ds_exp: error") == 1
    assert not list(tmp_path.glob("*m16*"))  # nothing written, no temporary left


@pytest.mark.slow
def test_chat_cuts_what_the_positions_cannot_hold_skips_a_line_not_utf8_and_refuses_nan(zero0, tmp_path, capsys):
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from ds_exp.config.paths import embedded_tokenizer_dir
    from ds_exp.exports.cli import chat_main

    def piped(data: bytes) -> None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(data))

    saved = sys.stdin
    try:
        long = " ".join(["apple"] * 3000)  # thousands of tokens, the model has 512 positions
        piped(f"{PROMPT}\n".encode() + b"caf\xe9 au lait\n" + f"{long}\n".encode())
        assert chat_main([str(zero0.run_dir / "hf_model-step2"), "--max-new-tokens", "4"]) == 1
        out, err = capsys.readouterr()
        assert len(out.splitlines()) == 2, out  # the two lines of text are answered
        assert "line 2 of standard input is not UTF-8 text (byte 0xe9 at character 4): not answered" in err
        assert "the model's 512 positions less --max-new-tokens=4 leave 508: its first" in err

        tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())  # a learned position table: OPT
        config = OPTConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        )
        OPTForCausalLM(config).save_pretrained(tmp_path / "opt")
        tokenizer.save_pretrained(tmp_path / "opt")
        piped(f"{long}\n".encode())
        assert chat_main([str(tmp_path / "opt"), "--max-new-tokens", "8"]) == 0  # not an IndexError
        assert "positions less --max-new-tokens=8 leave 56" in capsys.readouterr().err

        shutil.copytree(zero0.run_dir / "hf_model-step2", tmp_path / "nan")
        weights = load_file(tmp_path / "nan" / "model.safetensors")
        weights[next(iter(weights))][0] = float("nan")
        save_file(weights, tmp_path / "nan" / "model.safetensors", metadata={"format": "pt"})
        piped(f"{PROMPT}\n".encode())
        assert chat_main([str(tmp_path / "nan")]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'nan'}: the weights are not finite (NaN or inf) in" in err and "Traceback" not in err

        # issue 39 §6: a chat template asked of a tokenizer without one, and a template that raises: one line each
        piped(f"{PROMPT}\n".encode())
        assert chat_main([str(zero0.run_dir / "hf_model-step2"), "--template", "chat_template"]) == 2
        err = capsys.readouterr().err
        assert "--template chat_template: the tokenizer in" in err and "has no chat template" in err
        shutil.copytree(zero0.run_dir / "hf_model-step2", tmp_path / "raising")
        broken = AutoTokenizer.from_pretrained(tmp_path / "raising")
        broken.chat_template = "{{ raise_exception('only system turns') }}"
        broken.save_pretrained(tmp_path / "raising")
        piped(f"{PROMPT}\n".encode())
        assert chat_main([str(tmp_path / "raising"), "--template", "chat_template"]) == 2
        err = capsys.readouterr().err
        assert "the tokenizer's chat template failed on this conversation" in err and "only system turns" in err
        assert "Traceback" not in err
    finally:
        sys.stdin = saved


@pytest.mark.slow
def test_export_of_a_zero3_checkpoint_on_two_ranks_in_bf16(tmp_path_factory, cache_dir, tmp_path):
    run = launch(
        tmp_path_factory.mktemp("zero3") / "run",
        *FAST,
        "zero=stage3",
        "precision=bf16",
        "train.max_steps=2",
        "train.save_every=1",
        "train.export_every=1",
        f"eval.prompts=[{PROMPT!r}]",
        "eval.max_new_tokens=4",
        "eval.temperature=0.8",  # sampling on two ranks that generate together (ZeRO-3)
        launcher="ranks",
        nproc=2,
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    assert len((run.run_dir / "generations.jsonl").read_text().splitlines()) == 2
    assert export(run.run_dir / "checkpoints" / "step1", tmp_path / "m1") == 0
    same_export(tmp_path / "m1", run.run_dir / "hf_model-step1")
    assert json.loads((tmp_path / "m1" / "ds_exp_export.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_export_of_a_zero2_lora_checkpoint_merged_and_as_an_adapter(
    tmp_path_factory, cache_dir, tmp_path, compose_cfg, capsys
):
    """Issue 41 §8: the command writes what the run's own export of that step holds, the adapter always and the
    merged model where the run's train.export_merged puts one (or --merged asks for it)."""
    from omegaconf import OmegaConf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer

    run = train_here(
        tmp_path_factory.mktemp("lora") / "run",
        *FAST,
        "zero=stage2",
        "lora.dim=8",
        "train.max_steps=2",
        "train.save_every=1",
        "train.export_every=1",
        "train.export_merged=every",  # step exports merged too (by default a LoRA run's are adapters alone)
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    step1 = run.run_dir / "checkpoints" / "step1"
    assert export(step1, tmp_path / "merged") == 0
    same_export(tmp_path / "merged", run.run_dir / "hf_model-step1")
    adapter_file = "adapter_model.safetensors"
    same_export(tmp_path / "merged_adapter", run.run_dir / "hf_model-step1_adapter", adapter_file)
    assert export(step1, tmp_path / "adapter", "--adapter") == 0
    same_export(tmp_path / "adapter", run.run_dir / "hf_model-step1_adapter", "adapter_model.safetensors")
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    assert export(step1, "--adapter") == 0  # by default beside the run's: the run's own of that step is replaced
    origin = json.loads((run.run_dir / "hf_model-step1_adapter" / "ds_exp_export.json").read_text())["origin"]
    assert origin["written_by"] == "python -m ds_exp.export" and origin["step"] == 1
    # a later attempt of the run asks for the default, train.export_merged=end: the merged model at its last step only
    later = OmegaConf.load(run.run_dir / ".hydra" / "config.yaml")
    later.train.export_merged = "end"
    (run.run_dir / ".hydra" / "resume-2030-01-01_00-00-00").mkdir()
    OmegaConf.save(later, run.run_dir / ".hydra" / "resume-2030-01-01_00-00-00" / "config.yaml")
    capsys.readouterr()
    assert export(step1, tmp_path / "rule") == 0
    assert not (tmp_path / "rule").exists()
    same_export(tmp_path / "rule_adapter", run.run_dir / "hf_model-step1_adapter", adapter_file)
    assert "no merged model at step 1 (train.export_merged=end): --merged adds it" in capsys.readouterr().out
    assert export(step1, tmp_path / "asked", "--merged") == 0
    same_export(tmp_path / "asked", run.run_dir / "hf_model-step1")
    assert (tmp_path / "asked_adapter" / adapter_file).is_file()
    assert export(run.run_dir / "checkpoints" / "step2", tmp_path / "last") == 0  # the last step: the final export's
    assert (tmp_path / "last" / "model.safetensors").is_file() and (tmp_path / "last_adapter" / adapter_file).is_file()
    # reloaded as users do: the merged model, and the adapter on its base (the seeded tiny model, rebuilt)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    cfg = compose_cfg()
    base = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}}).model
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_lora_run_whose_base_moved_is_resumed_exported_and_scored_from_where_it_is_now(tmp_path, cache_dir, capsys):
    """Issue 39 §6: a LoRA run's base is known by the SHA-256 of its frozen weights, not by its path. Moved (the
    same bytes), it is named again with model.name_or_path=<new place> (resume) or --base (export, evaluate); where
    it was is said to be gone, with that fix; another model at the new place is refused."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ds_exp.core.errors import ConfigError
    from ds_exp.evaluation.cli import parser
    from ds_exp.evaluation.plan import make_plan
    from ds_exp.resume.store import read_marker

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "ds_exp" / "assets" / "tokenizer")
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tokenizer)
    )
    for seed, name in ((0, "base"), (1, "other")):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    base, moved, run_dir = tmp_path / "base", tmp_path / "moved", tmp_path / "run"
    lora = ["model=local", "lora.dim=8", "train.save_every=1"]
    run = train_here(run_dir, *FAST, *lora, f"model.name_or_path={base}/", "train.max_steps=2", cache_dir=cache_dir)
    assert run.ok, run.explain()
    base.rename(moved)
    step1, step2 = run_dir / "checkpoints" / "step1", run_dir / "checkpoints" / "step2"
    gone = f"the base model directory is gone: {base}/"

    again = train_here(run_dir, "resume=auto", "train.max_steps=3")
    assert again.proc.returncode == 2 and gone in again.proc.stderr, again.explain()
    assert "point model.name_or_path at where it is now" in again.proc.stderr
    capsys.readouterr()
    assert export(step1, tmp_path / "e1") == 2
    assert f"{gone} (the run's model.name_or_path) no longer exists; give --base DIR" in capsys.readouterr().err
    assert export(step1, tmp_path / "e1", "--base", moved) == 0
    adapter = json.loads((tmp_path / "e1_adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(moved)
    with pytest.raises(ConfigError, match=re.escape(gone)):
        make_plan(parser().parse_args([str(step2), "ds_exp_synthetic"]))
    plan = make_plan(parser().parse_args([str(step2), "ds_exp_synthetic", "--base", str(moved)]))
    assert plan.checkpoint == step2 and plan.cfg is not None and plan.cfg.model.name_or_path == str(moved)

    other = train_here(run_dir, "resume=auto", "train.max_steps=3", f"model.name_or_path={tmp_path / 'other'}")
    assert other.proc.returncode != 0 and "the frozen base weights it continues are not those" in other.proc.stderr
    assert not (run_dir / "checkpoints" / "step3").exists()
    again = train_here(run_dir, "resume=auto", "train.max_steps=3", f"model.name_or_path={moved}")
    assert again.ok, again.explain()
    assert again.summary["resumed_from"] == str(step2)
    assert read_marker(run_dir / "checkpoints" / "step3")["settings"]["model"] == str(moved)


@pytest.mark.slow  # the SmolLM2 fixture (cached after its first build)
def test_chat_renders_a_real_chat_template_turn_by_turn(smollm2_dir):
    from transformers import AutoTokenizer

    from ds_exp.data.templates import render_conversation, render_prompt
    from ds_exp.exports.chat import choose_template

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert choose_template("auto", None, tokenizer) == "chat_template"  # an export from elsewhere
    assert choose_template("auto", "dschat", tokenizer) == "dschat"  # what the run trained with wins
    turns = [("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?")]
    messages = [{"role": role, "content": content} for role, content in turns]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_conversation(turns, "chat_template", tokenizer) == (expected, False)
    assert expected.count("<|im_start|>assistant") == 2 and expected.endswith("<|im_start|>assistant\n")
    assert render_conversation(turns[:1], "chat_template", tokenizer) == render_prompt(
        turns[0][1], "chat_template", tokenizer
    )
