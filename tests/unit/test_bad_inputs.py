"""Each case of the bad-input catalogue (tests/bad_inputs.py, docs/bad_inputs.md): one message that names what
is wrong and how to fix it, a non-zero exit, no traceback, and nothing left that looks like a finished run.

Cases refused before any heavy work run through the CLI's own main() in this process (a tripwire stands in for the
training stack: one that gets past the checks fails); those the run itself refuses (REFUSED_BY_THE_RUN), and a few
of the others for the real path (REAL_PATH), run `python -m ds_exp` as a process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bad_inputs import (
    CASES,
    REAL_PATH,
    REFUSED_BY_THE_RUN,
    Case,
    message_of,
    prepare,
    run_case,
    run_case_in_process,
)
from tests.training import REPO, user_env
from tests.zygote import run_python

KINDS = {"config value", "combination", "path", "DeepSpeed JSON", "data row", "launch", "sweep"}


def test_the_catalogue_is_broad_and_documented():
    assert len(CASES) >= 30
    assert {case.kind for case in CASES} == KINDS
    assert len({case.id for case in CASES}) == len(CASES)
    docs = (REPO / "docs" / "bad_inputs.md").read_text()
    missing = [case.id for case in CASES if f"| {case.id} |" not in docs]
    assert not missing, f"docs/bad_inputs.md lacks {missing}: regenerate it with python -m tests.bad_inputs"


def _runs(case: Case) -> list[str]:
    if case.id in REFUSED_BY_THE_RUN:
        return ["process"]
    return ["in-process", "process"] if case.id in REAL_PATH else ["in-process"]


def _params() -> list:
    """Refused before heavy work: in-process, in the quick tier; those the run refuses: a process, slow."""
    params = []
    for case in CASES:
        for how in _runs(case):
            name = f"{case.id}-{how}" if len(_runs(case)) > 1 else case.id
            marks = [pytest.mark.slow] if case.id in REFUSED_BY_THE_RUN else []
            params.append(pytest.param(case, how, id=name, marks=marks))
    return params


@pytest.mark.parametrize(("case", "how"), _params())
def test_bad_input_gets_one_clear_message(case: Case, how: str, tmp_path):
    outcome = run_case(case, tmp_path) if how == "process" else run_case_in_process(case, tmp_path)
    assert "ReachedHeavyWork" not in outcome.output, (
        f"{case.id} reached the training stack: list it in REFUSED_BY_THE_RUN"
    )
    assert outcome.returncode != 0, outcome.output[-3000:]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    message = message_of(outcome)
    for fragment in case.expect:
        assert fragment in message, f"{fragment!r} not in the message:\n{message}\n--- all output\n{outcome.output}"
    assert message.count("ds_exp: error") <= 1, message
    # nothing that looks like a finished run
    for summary in tmp_path.rglob("summary.json"):
        assert json.loads(summary.read_text())["status"] != "completed", summary
    assert not list(tmp_path.rglob("hf_model")), "an export was written"
    assert not list(tmp_path.rglob("ds_exp_complete.json")), "a checkpoint was completed"
    # refused before any work: no directory the attempt made stays, with a summary.json "failed" in it that looks
    # like a run (issue 35 §8); what the case's own files made stays as it was
    assert not attempts_left(case, tmp_path), f"{case.id} left {attempts_left(case, tmp_path)}"


def attempts_left(case: Case, tmp: Path) -> list[str]:
    """The run directories under `tmp` (Hydra's .hydra/ or ds_exp's lock in them) that the case's files did not
    make."""
    given = {Path(name).parts[0] for name in case.files} | {Path(name).parts[0] for name in case.links}
    found = {p.parent for pattern in (".hydra", ".ds_exp.lock") for p in tmp.rglob(pattern)}
    return sorted(str(d.relative_to(tmp)) for d in found if d.relative_to(tmp).parts[0] not in given)


def test_a_bad_data_row_is_refused_before_torch_and_deepspeed_load(tmp_path):
    """The data's rows are read with the config's checks (issue 41 §5): a bad row is refused in seconds, where the
    imports of torch, DeepSpeed and transformers took a minute under load before it."""
    args, env = prepare(next(case for case in CASES if case.id == "conversation without an answer"), tmp_path)
    proc = run_python(["-X", "importtime", "-m", "ds_exp", *args], cwd=tmp_path, env={**user_env(), **env}, fresh=True)
    imported = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and said[-1].startswith("ds_exp: error: data.sources[0]: "), said
    assert "datasets" in imported and not imported & {"torch", "deepspeed", "transformers"}
