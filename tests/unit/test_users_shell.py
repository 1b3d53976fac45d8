"""The tests hold in a user's shell (issue 31 §10): the variables users keep set (HF_HUB_OFFLINE=1,
TRANSFORMERS_OFFLINE=1, WANDB_MODE=offline, HF_HOME elsewhere, HYDRA_FULL_ERROR=1) change what some tests mean, so
the tests run as on a machine where none is set (tests/training.py, applied by conftest.py before any test), and a
test that means one of them sets it itself (the catalogue's "hub id with the hub offline in the user's shell")."""

from __future__ import annotations

from tests.bad_inputs import CASES, message_of, run_case_in_process
from tests.training import SHELL_ENVIRON, USER_SHELL_VARIABLES, pin_test_environment, user_env, without_user_shell

USERS_SHELL = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "HF_HOME": "/tmp/somewhere",
    "HYDRA_FULL_ERROR": "1",
}


def test_the_tests_see_none_of_the_users_shell_variables(monkeypatch, tmp_path):
    assert set(USERS_SHELL) <= set(USER_SHELL_VARIABLES)
    for name in USER_SHELL_VARIABLES:  # the tests' environment (conftest.py) and every process a test starts
        assert name not in SHELL_ENVIRON, name
    assert without_user_shell({**SHELL_ENVIRON, **USERS_SHELL}) == SHELL_ENVIRON
    seen = {name: user_env().get(name) for name in USERS_SHELL}
    assert seen == {**dict.fromkeys(USERS_SHELL), "WANDB_MODE": "disabled"}

    # a case whose message those variables change (the hub's offline mode names itself) holds once they are pinned
    for name, value in USERS_SHELL.items():
        monkeypatch.setenv(name, value)
    pin_test_environment()
    case = next(case for case in CASES if case.id == "hub id with no hub to reach")
    outcome = run_case_in_process(case, tmp_path)
    assert outcome.returncode == 2 and "Traceback" not in outcome.output, outcome.output
    assert all(fragment in message_of(outcome) for fragment in case.expect), outcome.output
