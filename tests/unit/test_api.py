"""The Python API refuses what the command line refuses, with the same message, as one exception type
(issue 35 §9): `from ds_exp import train; train([...])` raises a DsExpError whose text is what `python -m ds_exp`
prints after "ds_exp: error:", secrets blanked, and leaves nothing behind. In this process, before any heavy work:
a tripwire stands in for the training stack (tests/bad_inputs.py), so a case that got past the checks fails."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

from ds_exp import DsExpError, train
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.launch import cli, lock
from tests.bad_inputs import (
    CASES,
    LAUNCH_VARIABLES,
    REFUSED_BY_THE_RUN,
    Case,
    _tripwire,
    prepare,
    run_case_in_process,
)
from tests.training import user_env


def one_case_per_kind() -> list[Case]:
    """The first case of each kind the checks refuse before any heavy work, that is a single run's overrides."""
    chosen: dict[str, Case] = {}
    for case in CASES:
        single = not any(a.startswith("-") for a in case.args) and not case.env and not case.fifos
        if single and case.id not in REFUSED_BY_THE_RUN:
            chosen.setdefault(case.kind, case)
    return list(chosen.values())


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A user's shell in `tmp_path` (relative paths of the cases are taken from there), no launcher variables."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers = root.handlers[:]
    yield tmp_path
    assert root.handlers == handlers  # the run's handlers (ds_exp.log, Hydra's console) are gone
    assert not GlobalHydra.instance().is_initialized() and not lock._locks  # Hydra's state and the lock let go


@pytest.mark.parametrize("case", one_case_per_kind(), ids=lambda case: case.id)
def test_the_api_refuses_what_the_command_line_refuses_with_its_message(case, here):
    args, env = prepare(case, here)
    for name, value in env.items():
        os.environ[name] = value
    with _tripwire(cli), pytest.raises(DsExpError) as refused:
        train(args)
    for fragment in case.expect:
        assert fragment in str(refused.value), f"{fragment!r} not in {refused.value}"
    assert refused.value.__cause__ is None and refused.value.__suppress_context__  # no chain behind it
    assert not list(here.rglob("summary.json")) and not (here / "run" / ".hydra").exists()


@pytest.mark.parametrize("case_id", ["unknown option", "a key ds_exp no longer has", "conversation without an answer"])
def test_a_refusal_is_one_line_on_the_command_line_and_that_line_in_python(case_id, here):
    """Hydra's refusal (zero=stage5), a removed key, a bad data row (issue 41 §3): the command line prints
    `ds_exp: error: TEXT` alone and exits 2; the API's DsExpError is TEXT, word for word."""
    case = next(case for case in CASES if case.id == case_id)
    command_line = run_case_in_process(case, here)
    args, env = prepare(case, here)
    os.environ.update(env)
    with _tripwire(cli), pytest.raises(DsExpError) as refused:
        train(args)
    assert (command_line.returncode, command_line.stderr) == (2, f"ds_exp: error: {refused.value}\n")


def test_the_api_says_what_it_takes_and_keeps_secrets_out_of_its_messages(here, monkeypatch):
    with pytest.raises(ConfigError, match=r"train\(\) takes a list of overrides, e.g. train\(\['lora.dim=8'\]\)"):
        train("lora.dim=8")  # type: ignore[arg-type]
    example = r"takes a list of overrides, e.g. train\(\['train.max_steps=10'\]\)"
    for wrong, what in ((None, "None"), ({"lora.dim": 8}, "a dict"), (8, "a int")):
        with pytest.raises(ConfigError, match=rf"{example}, not {what}$"):
            train(wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"not command-line flags: -m; a sweep \(-m\) .* `python -m ds_exp`"):
        train(["-m", "zero=stage2,stage3"])
    # Hydra's own refusal of a key is a ConfigError with the command line's one line, and a secret's value is never
    # in it
    with pytest.raises(ConfigError) as unknown:
        train(["trian.max_steps=3", "my_service_token=hunter2-7f3a9c"])
    assert str(unknown.value) == (
        "trian.max_steps: ds_exp's config has no key trian; did you mean train? "
        "`python -m ds_exp --help` lists the keys"
    )
    with pytest.raises(ConfigError) as secret:
        train(["my_service_token=hunter2-7f3a9c"])
    assert "has no key my_service_token" in str(secret.value) and "hunter2" not in str(secret.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"train\(\) runs one rank in this process, and this one was launched"):
        train([])
    assert not (here / "outputs").exists()  # nothing of any of them


def test_the_apis_first_call_leaves_deepspeeds_import_notice_to_the_log(tmp_path):
    """DeepSpeed logs "Setting accelerator to CPU" when it is imported; the API's first call imports it once the
    run's logging holds such records for its log file: a notebook sees only what ds_exp says (issue 41 §10)."""
    code = "from ds_exp import DsExpError, train\ntry:\n    train(['zero=stage9'])\n"
    code += "except DsExpError as err:\n    print(err)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=user_env(), capture_output=True, text=True)
    assert (out.stdout, out.stderr) == ("zero=stage9: zero has no option stage9; its options: stage0, stage1, stage2, "
                                        "stage3\n", ""), out.stderr  # fmt: skip


def test_a_users_hydra_callback_that_raises_fails_the_run_with_its_message(here):
    """Hydra 1.3 only warns when a callback raises (issue 39 §6): through the API it fails the run. At the job's
    start nothing of the attempt stays; at its end (a dry run here) the run's directory stays, the lock let go."""
    mine = "+hydra.callbacks.mine._target_=tests.bad_inputs.FailingCallback"
    with _tripwire(cli), pytest.raises(RunFailed) as at_start:
        train([mine, f"hydra.run.dir={here}/first"])
    assert str(at_start.value) == (
        "the Hydra callback tests.bad_inputs.FailingCallback.on_job_start failed: ValueError: my check refused this job"
    )
    assert not (here / "first").exists()
    with pytest.raises(RunFailed, match=r"FailingCallback.on_job_end failed: ValueError: my upload failed$"):
        train([mine, "+hydra.callbacks.mine.when=on_job_end", "dry_run=true", f"hydra.run.dir={here}/second"])
    assert (here / "second" / "plan.json").is_file() and not (here / "second" / lock.LOCK).exists()
