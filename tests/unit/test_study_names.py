"""An optuna study's default name and what a study refused to continue says (issue 35 §12): a second search in the
same project is a study of its own; the same command continues its study; a named study that cannot continue says
what changed as the command line writes it."""

from __future__ import annotations

import json

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution, distribution_to_json

from ds_exp.config.paths import conf_dir
from ds_exp.core.errors import ConfigError
from ds_exp.sweeps.study_files import STUDY_FILE, check_study_dir, search_expression

LR = "optimizer.lr=tag(log,interval(1e-5,1e-3))"


@pytest.fixture(scope="module")
def sweep():
    """compose(*overrides) -> the sweep's config as `python -m ds_exp -m hydra/sweeper=optuna OVERRIDES` has it."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        def compose(*overrides: str):
            args = ["hydra/sweeper=optuna", *overrides]
            return loader.load_configuration("config", args, run_mode=RunMode.MULTIRUN), loader

        yield compose


def test_each_search_is_a_study_of_its_own_and_the_same_command_continues_it(sweep):
    name = lambda *overrides: str(sweep(*overrides)[0].hydra.sweeper.study_name)  # noqa: E731
    first = name(LR, "train.max_steps=16")
    assert first.startswith("default-lr-") and len(first) == len("default-lr-") + 6
    # the same search: the same study, whatever the order, the trial count or the launcher
    assert name("train.max_steps=16", LR, "hydra.sweeper.n_trials=40", "hydra.sweeper.n_jobs=2") == first
    assert name(LR, "train.max_steps=16", "resume=auto") == first
    # another search is another study: other keys, another range, other fixed overrides, another objective
    others = [
        name("lora.dim=choice(8,16)", "zero=stage2,stage3", "train.max_steps=16"),
        name("optimizer.lr=tag(log,interval(1e-5,1e-2))", "train.max_steps=16"),
        name(LR, "train.max_steps=32"),
        name(LR, "train.max_steps=16", "hydra.sweeper.objective=train_loss"),
    ]
    assert others[0].startswith("default-dim-zero-")
    assert len({first, *others}) == 1 + len(others), others
    # a search given in hydra.sweeper.params (an experiment file's way) is the same search as on the command line
    assert (
        name("train.max_steps=16", "+hydra.sweeper.params={optimizer.lr: 'tag(log,interval(1e-5,1e-2))'}") == others[1]
    )
    assert name(LR, "experiment_name=mine").startswith("mine-lr-")
    assert str(sweep(LR)[0].hydra.sweep.dir) == f"outputs/optuna/{name(LR)}"


def test_every_trial_of_a_study_lands_in_its_study_directory(sweep):
    """A trial's config is composed from its own overrides (no search in them): it takes the name its sweep
    resolved (Hydra copies the sweep config's resolver cache into each job's), not one of its own."""
    master, loader = sweep(LR, "train.max_steps=16")
    study_dir = str(master.hydra.sweep.dir)
    trial = loader.load_sweep_config(master, ["train.max_steps=16", "optimizer.lr=0.0001"])
    assert str(trial.hydra.sweep.dir) == study_dir and str(trial.hydra.sweeper.study_name) in study_dir


def test_a_study_that_cannot_continue_says_what_changed_as_the_command_line_writes_it(tmp_path):
    lr = distribution_to_json(FloatDistribution(1e-5, 1e-3, log=True))
    identity = {"study_name": "default-lr-0a1b2c", "storage": "sqlite:///x", "objective": "final_eval.eval_loss"}
    identity |= {"direction": "minimize", "search_space": {"optimizer.lr": lr}, "fixed": ["train.max_steps=8", "a=1"]}
    (tmp_path / STUDY_FILE).write_text(json.dumps({**identity, "n_trials": 3, "trials": []}))
    changed = {
        "search_space": {"optimizer.lr": distribution_to_json(FloatDistribution(1e-4, 1e-2))},
        "fixed": ["train.max_steps=9", "a=1", "zero=stage3"],
    }
    with pytest.raises(ConfigError) as err:
        check_study_dir(tmp_path, {**identity, **changed})
    assert err.value.problems == [
        f"hydra.sweep.dir={tmp_path} holds optuna study default-lr-0a1b2c, started with other settings (nothing was "
        "changed):",
        "search of optimizer.lr: was tag(log,interval(1e-05,0.001)), now interval(0.0001,0.01)",
        "every trial got train.max_steps=8, now train.max_steps=9",
        "every trial got no zero, now zero=stage3",
        "Continue it with the settings it has (n_trials and the launcher may change), or start another study: leave "
        "hydra.sweeper.study_name unset (each search is a study of its own) or name one, e.g. "
        "hydra.sweeper.study_name=default-lr-0a1b2c-2",
    ]


def test_a_search_space_is_written_back_as_the_expressions_that_make_it():
    expressions = {
        FloatDistribution(1e-5, 1e-3, log=True): "tag(log,interval(1e-05,0.001))",
        FloatDistribution(0.1, 0.9): "interval(0.1,0.9)",
        IntDistribution(1, 8): "tag(int,interval(1,8))",
        IntDistribution(1, 64, log=True): "tag(int,log,interval(1,64))",
        IntDistribution(2, 16, step=2): "range(2,18,2)",
        CategoricalDistribution(["stage2", "stage3"]): "choice(stage2,stage3)",
    }
    for distribution, expression in expressions.items():
        assert search_expression(distribution_to_json(distribution)) == expression
    assert search_expression(None) == "not searched"
