"""The install (issue 41 §1): `pip install -e .` (or a built wheel) is the core, and it holds every package ds_exp
imports where a run that turns on no extra goes; each other package is one extra's (named where it is missing,
tests/unit/test_tracker_table.py). Read from the source (every import of ds_exp/ and hydra_plugins/) and
pyproject.toml: no install here. That a wheel of the core alone trains the default run from any directory was
checked once by hand in a venv holding only the core's packages (the README's quick start says how to build it)."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.training import REPO

# modules that only a feature behind an extra imports, and that extra (ds_exp imports them where the feature runs)
EXTRA_OF = {
    "mlflow": "mlflow",
    "sqlalchemy": "mlflow",  # and optuna's: the stores of both
    "optuna": "optuna",
    "lm_eval": "eval",
    "tensorboardX": "tensorboard",
    "liger_kernel": "gpu",
}
NOT_ON_PYPI = {"oneccl_bindings_for_pytorch"}  # Intel's oneCCL bindings: only where installed (launch.environment)


def third_party_imports() -> set[str]:
    found = set()
    for path in [*(REPO / "ds_exp").rglob("*.py"), *(REPO / "hydra_plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name not in ("ds_exp", "hydra_plugins")}


def test_the_core_install_holds_every_package_ds_exp_imports_outside_its_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    extras = {
        name: {canonicalize_name(Requirement(r).name) for r in requirements}
        for name, requirements in project["optional-dependencies"].items()
    }
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module in sorted(third_party_imports() - NOT_ON_PYPI):
        provided_by = {canonicalize_name(d) for d in distributions.get(module, [module])}
        declared = extras[EXTRA_OF[module]] if module in EXTRA_OF else core
        if not provided_by & declared:
            where = f"the {EXTRA_OF[module]} extra" if module in EXTRA_OF else "the core dependencies"
            missing.append(f"{module} ({', '.join(sorted(provided_by))}) is not in {where}")
    assert not missing, missing
    assert extras["dev"] >= {"pytest", "ruff", "mypy"} and not core & {"pytest", "ruff", "mypy"}  # the 2nd command's
