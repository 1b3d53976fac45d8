"""The console a person reads: run on a terminal (a pty), rank 0 shows ds_exp's own lines, each `ds_exp: ...`,
and its progress bar, as the README shows them; every library line is in the rank log files; a log line never
shares the bar's line; nothing comes after the final line; a refusal of every rank is one line. (A piped run, the
sweep's console and a wandb run's: tests/integration/test_training.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.console import ANSI, BAR, MACHINE_STATE, on_terminal, readme_console, rendered, shape
from tests.training import REPO, Run, free_port, user_env

# What libraries print or log on their own (DeepSpeed's CPU Adam from C++, its schedule's warning, transformers'
# bars, DeepSpeed's import-time notices, torch's deprecations): none of it reaches the console.
LIBRARY_LINES = (
    "Adam Optimizer #",
    "Config: alpha=",
    "lr_schedules",
    "Attempting to get learning rate",
    "Loading weights",
    "Writing model shards",
    "Saving the dataset",
    "Setting accelerator",
    "built successfully",
    "FutureWarning",
    "gcc ",
    "rank 1 of 2",
    "{'num_",
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A Hugging Face checkpoint directory of a small Llama and the embedded tokenizer (model=local)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "ds_exp" / "assets" / "tokenizer")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tokenizer)
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.mark.slow
def test_a_zero3_run_on_two_ranks_prints_only_its_own_lines(tmp_path, cache_dir, tiny_checkpoint):
    """One run checked for the whole console: a local checkpoint (its loading), DeepSpeed's CPU Adam and schedule
    (optimizer.owner / scheduler.owner = deepspeed, as a user's JSON), ZeRO-3 generation, a checkpoint and the
    export; a small data set (1 step per epoch over 6 steps) for the evaluation cadence; a metric line only every
    4 steps, while the bar shows a loss from step 1."""
    run_dir = tmp_path / "run"
    overrides = [
        "model=local",
        f"model.name_or_path={tiny_checkpoint}",
        "zero=stage3",
        "offload=cpu",
        "optimizer.owner=deepspeed",
        "scheduler.owner=deepspeed",
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.log_every=4",
        "data.synthetic.num_train=8",
        "data.synthetic.num_eval=16",
        "eval.prompts=[hi]",
        "eval.max_new_tokens=4",
        f"data.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**user_env(), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    cmd = [str(REPO / "launchers" / "torchrun.sh"), "2", *overrides]
    code, console = on_terminal(cmd, cwd=tmp_path, env=env, timeout=600)
    run = Run(subprocess.CompletedProcess(cmd, code, console, ""), run_dir)
    assert run.ok, run.explain()

    # every library line is in the rank's log file, none on the console
    for noise in LIBRARY_LINES:
        assert noise not in console, noise
    rank0 = (run_dir / "logs" / "rank0.log").read_text()
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    for said in ("Adam Optimizer #", "Attempting to get learning rate from scheduler", "Setting accelerator to CPU"):
        assert said in rank0 and said in rank1, said
    assert "rank 1 of 2" in rank1
    assert rank1.count("is deprecated") <= 2  # each library warning once, not once per step

    # a terminal shows the bar alone on its line, and each message on a line of its own
    shown = rendered(console)
    for line in shown:
        if BAR.match(line):
            assert line.endswith("]"), f"a message continues the bar's line: {line!r}"
        else:
            assert "%|" not in line and "it/s" not in line, f"bar residue before a message: {line!r}"
    ours = [line for line in shown if line.strip() and not BAR.match(line) and not line.startswith(MACHINE_STATE)]
    assert len(ours) <= 22, "\n".join(ours)
    # each line is ds_exp's (torchrun's OMP_NUM_THREADS banner, Hydra's prefix: gone), the final line last
    assert all(line.startswith("ds_exp: ") for line in ours), "\n".join(ours)
    assert ours[-1].startswith("ds_exp: completed 6 steps in "), "\n".join(ours)
    assert shown[-1] == "" and ours[-1] == [line for line in shown if line.strip()][-1]
    # what the user asked for, said before anything is loaded
    training = next(line for line in ours if line.startswith("ds_exp: training: "))
    assert "ZeRO stage 3, fp32, offload optimizer states to cpu, every parameter trained" in training, training
    text = "\n".join(ours)
    for line in ("trainable (100.00%)", "data: 8 train / 16 eval examples", "saved checkpoint", "exported"):
        assert line in text, line
    loading = text.index(f"loading the weights of {tiny_checkpoint} ...")
    generating = text.index("generating 1 prompts (up to 4 new tokens each) ...")
    assert loading < generating < text.index("step 0: 'hi' -> ")

    # the bar's loss from step 1, though the first metric line is at step 4
    segments = re.split(r"[\r\n]", ANSI.sub("", console))
    assert any(re.match(r"train: .*\b1/6 .*loss=\d", s) for s in segments), [s for s in segments if "/6 " in s]
    assert [r["step"] for r in run.records("train")] == [4, 6]

    # 6 one-step epochs: not 6 evaluations (train.max_evals=5), one every ceil(6 / 5) = 2 steps, and the start
    assert [r["step"] for r in run.records("eval")] == [0, 2, 4, 6]


@pytest.mark.slow
def test_the_default_run_on_a_terminal_reads_as_the_readme_shows(tmp_path, cache_dir):
    """`python -m ds_exp` on a terminal, line by line as the README's console block shows it (numbers, times,
    paths and the host aside: tests/console.py's shape), ending on the final line; a shorter run of the same
    shape (fewer rows and steps)."""
    cmd = [
        sys.executable,
        "-m",
        "ds_exp",
        "train.max_steps=12",
        "data.synthetic.num_train=256",  # one epoch: evaluated at the start and the end, as the default
        "data.synthetic.num_eval=16",
        f"data.cache_dir={cache_dir}",
    ]
    code, console = on_terminal(cmd, cwd=tmp_path, env={**user_env(), "MASTER_PORT": str(free_port())}, timeout=600)
    assert code == 0, console[-3000:]
    shown = [line for line in rendered(console) if line.strip()]
    # a first run on a machine compiles an op (or waits for another process's build) and tokenizes its data:
    # said, and not in the README's block
    extra = (*MACHINE_STATE, "Tokenizing ")
    said = [shape(line) for line in shown if not line.startswith(extra)]
    assert said == [shape(line) for line in readme_console() if not line.startswith(extra)], "\n".join(shown)
    assert shown[-1].startswith("ds_exp: completed 12 steps in ")  # nothing after the final line
    assert re.search(r"run directory outputs/default/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d$", shown[-1]), shown[-1]


@pytest.mark.slow
def test_a_refusal_every_rank_hits_is_one_line(tmp_path):
    """3 ranks under launchers/torchrun.sh, each refused at validation: the message once (not once per rank),
    then nothing (torchrun's 30-line report of the failed ranks left out), exit status 2, and no run directory."""
    env = {**user_env(), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    cmd = [str(REPO / "launchers" / "torchrun.sh"), "3", "train.max_evals=0"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout + out.stderr) == (2, "ds_exp: error: train.max_evals=0: must be >= 1\n")
    assert not (tmp_path / "outputs").exists()


def test_tokenizing_shows_a_bar_for_a_large_set_only_and_not_the_saving_one(tmp_path, capfd, compose_cfg, monkeypatch):
    """The data pipeline's bars say what it does (tokenizing) where that takes a while; a set that tokenizes in a
    blink (the default's 200 eval rows) draws no bar between ds_exp's lines; datasets' "Saving the dataset" never."""
    import datasets

    from ds_exp.data import encode
    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.tokenizer import load_tokenizer

    monkeypatch.setattr(encode, "BAR_MIN_ROWS", 30)  # 40 train rows "large", 8 eval rows small
    # as in a fresh process: an in-process run earlier in this worker, logging off a terminal, turned bars off
    datasets.enable_progress_bars()
    cfg = compose_cfg("data.synthetic.num_train=40", "data.synthetic.num_eval=8", f"data.cache_dir={tmp_path}")
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    data = prepare_sft_data(cfg.data, tokenizer, seed=0)
    assert not data.stats["cache_hit"]
    err = capfd.readouterr().err
    assert "Tokenizing train" in err and "Tokenizing eval" not in err and "Saving the dataset" not in err


def test_the_sweep_plot_keeps_matplotlib_off_the_console(tmp_path):
    """matplotlib's first use logs "generated new fontManager" (INFO): through the root logger of a sweep's
    process (Hydra's console handler) it reached the console."""
    script = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='[HYDRA] %(message)s')\n"
        "from ds_exp.sweeps.report_plot import plot\n"
        "row = {'job': '0', 'status': 'completed', 'overrides': 'zero=stage2', 'tokens_per_s': 5.0,"
        " 'peak_memory_mib': 1.0}\n"
        "plot([row], Path(sys.argv[1]))\n"
    )
    env = {**user_env(), "MPLCONFIGDIR": str(tmp_path / "mpl")}  # a fresh one: the font cache is built
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "report.png")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "report.png").is_file()
    assert "fontManager" not in out.stdout + out.stderr


def test_the_evaluation_cadence_fits_small_data_sets(compose_cfg):
    """train.eval_every=0: after each epoch while that is at most train.max_evals evaluations (5), else evenly."""
    from ds_exp.config.plan import eval_interval
    from ds_exp.config.validate import config_problems

    train = compose_cfg().train
    assert eval_interval(train, 100, 60) == 0  # within one epoch: at the end only
    assert eval_interval(train, 100, 500) == 0  # 5 epochs: after each
    assert eval_interval(train, 2, 15) == 3  # 8 two-step epochs: 3, 6, 9, 12, 15
    assert eval_interval(train, 100, 600) == 120  # 6 epochs: 5 evaluations
    assert eval_interval(compose_cfg("train.eval_every=7").train, 2, 15) == 7
    assert eval_interval(compose_cfg("train.max_evals=20").train, 2, 15) == 0
    problems, _ = config_problems(compose_cfg("train.max_evals=0"), accelerator="cpu", world_size=1)
    assert problems == ["train.max_evals=0: must be >= 1"]
