"""Each case of the bad-input catalogue (tests/bad_inputs.py, docs/bad_inputs.md): one message that names what
is wrong and how to fix it, a non-zero exit, no traceback, and nothing left that looks like a finished run."""

from __future__ import annotations

import json

import pytest

from tests.bad_inputs import CASES, Case, message_of, run_case
from tests.training import REPO

KINDS = {"config value", "combination", "path", "DeepSpeed JSON", "data row", "launch", "sweep"}


def test_the_catalogue_is_broad_and_documented():
    assert len(CASES) >= 30
    assert {case.kind for case in CASES} == KINDS
    assert len({case.id for case in CASES}) == len(CASES)
    docs = (REPO / "docs" / "bad_inputs.md").read_text()
    missing = [case.id for case in CASES if f"| {case.id} |" not in docs]
    assert not missing, f"docs/bad_inputs.md lacks {missing}: regenerate it with python -m tests.bad_inputs"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gets_one_clear_message(case: Case, tmp_path):
    outcome = run_case(case, tmp_path)
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
