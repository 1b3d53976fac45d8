"""The package's shape holds as it grows: the folders are the layers and the features, imports go one way (down the
layers; the layers reach a feature only through ds_exp/config/features.py, bar its settings module), light packages
and every feature's settings, checks and entry never load torch or deepspeed, heavy modules import at the top, no
import cycle, libraries' private internals only in ds_exp/core/compat/, and importing ds_exp changes nothing of the
process. A module's size follows its concept: no line count is enforced."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from ds_exp.config.features import FEATURE_PACKAGES

PACKAGE = Path(__file__).resolve().parents[2] / "ds_exp"
MAX_TOP_MODULES = 8
# The layers, lowest first: a module imports only from its own package or a lower layer (ds_exp/__init__.py).
LAYERS = [
    "core",
    "config", "data", "resume", "launch", "sweeps",
    "runtime", "model", "checkpoint", "artifacts", "train", "tools",
]  # fmt: skip
LIGHT = ("config", "data", "resume", "launch", "sweeps")  # never torch, never deepspeed
# The features (ds_exp/config/features.py), above every layer: a layer imports only a feature's settings module (the
# schema types the feature's section with it); these modules of every feature are light.
FEATURES = tuple(name.removeprefix("ds_exp.") for name in FEATURE_PACKAGES)
FEATURE_LIGHT = ("feature", "settings", "checks")
# The one import that goes up: the command line hands a validated config to the training stack.
UPWARD = {("ds_exp.launch.cli", "ds_exp.train.recipe"), ("ds_exp.launch.cli", "ds_exp.tools.dry_run")}
# Imported inside the function that needs them, and why; every other import sits at the top of its module.
IMPORTED_WHERE_USED = {
    "flash_attn": "optional: only where installed",
    "oneccl_bindings_for_pytorch": "optional: Intel's oneCCL bindings, only where installed",
    "liger_kernel": "optional: only where installed",
    "torch.nn.attention.varlen": "a prototype of recent torch versions: only where its kernel runs (CUDA)",
    "submitit": "only inside a submitit job (every other launch skips its import time)",
    "matplotlib": "only where a picture is drawn: a run's plots/loss.png, the sweep report's, the study's, the "
    "harness chart (its import costs a second and logs on first use)",
    "optuna.visualization": "the study's picture (ds_exp/sweeps/study_plot.py): imports matplotlib's pyplot",
    "ds_exp.runtime.process_group": "the Python API: DeepSpeed, which it imports, logs on import; imported once "
    "hold_library_logs keeps that for the run's log file (not on the user's console)",
    "ds_exp.train.api": "the callable package ds_exp.train (from ds_exp import train): the training stack loads on the "
    "first call, not with every module of the package",
    "lm_eval": "optional extra (pip install -e .[eval]): only where lm-eval tasks are checked or scored",
    "psutil": "only for autotune's host-memory budget",
    "detect_secrets": "its package imports requests (0.2 s): loaded on the first text long enough to hold a token, "
    "never by --help",
    "datasets": "data/sources.py, for a save_to_disk directory or the hub only: reading and checking local files, "
    "as validation and the preference checks do, goes without its seconds of import",
    "ds_exp.data.pipeline": "where data is read: the CLI's job, past validation (datasets takes seconds to import, "
    "which --help and --cfg job do without); autotune: datasets reserves ~1 GB of address space, first it starves a "
    "memory limit",
    "ds_exp.train.recipe": "the CLI's one upward import (see UPWARD)",
    "ds_exp.tools.dry_run": "the CLI's one upward import (see UPWARD)",
    "ds_exp.exports.writer": "python -m ds_exp.export: --help and every refusal answer before torch is imported",
    "ds_exp.exports.chat": "python -m ds_exp.chat: --help and every refusal answer before torch is imported",
    "ds_exp.evaluation.harness": "imports lm-eval, an optional extra: only where tasks are scored (eval.harness.tasks, "
    "python -m ds_exp.evaluate, whose --help and every refusal answer before torch is imported)",
}
# uses (not mentions) of other libraries' private names that ds_exp relies on
PRIVATE = re.compile(
    r"hydra\._internal|\._zero3_consolidated\w*\(|import _parse_node_list|\._usr_sig\(|\._init_weights\(|\._notify\b"
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names]
        return names if node.module == "ds_exp" else [node.module, *names]  # `from ds_exp.core import compat`
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The ds_exp modules `path` imports, wherever the import statement is (lazy ones count: they still cycle)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        for name in imported(node):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def layer_of(module: str) -> int | None:
    """The layer index of a module of a layer package (a feature's: above every layer); None for the entry points at
    the top (ds_exp.report ...)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FEATURES:
        return len(LAYERS)
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def is_feature_settings(module: str) -> bool:
    parts = module.split(".")
    return len(parts) == 3 and parts[1] in FEATURES and parts[2] == "settings"


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    wrong = []
    for source, targets in graph.items():
        own = layer_of(source)
        if own is None:
            continue  # entry points may import anything
        for target in targets:
            theirs = layer_of(target)
            if theirs is None or target == "ds_exp":
                wrong.append((source, target))  # a layer never imports an entry point
            elif theirs > own and (source, target) not in UPWARD and not is_feature_settings(target):
                wrong.append((source, target))
    return sorted(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    files = modules()
    return {
        # a package's own __init__ importing its submodules is not a cycle with them
        name: {m for m in imports_of(path, set(files)) if m != name and not m.startswith(name + ".")}
        for name, path in files.items()
    }


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():  # the test above must be able to fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_imports_go_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_direction_check_finds_an_upward_import():  # the test above must be able to fail
    graph = {"ds_exp.config.schema": {"ds_exp.train.loop"}, "ds_exp.train.loop": {"ds_exp.config.schema"}}
    assert upward_imports(graph) == [("ds_exp.config.schema", "ds_exp.train.loop")]


def test_a_layer_reaches_a_feature_only_through_its_settings(monkeypatch):  # the layers' rule for features
    monkeypatch.setattr(sys.modules[__name__], "FEATURES", ("somefeature",))
    graph = {
        "ds_exp.config.schema": {"ds_exp.somefeature.settings"},
        "ds_exp.train.recipe": {"ds_exp.somefeature.hooks"},
        "ds_exp.somefeature.hooks": {"ds_exp.train.recipe"},
    }
    assert upward_imports(graph) == [("ds_exp.train.recipe", "ds_exp.somefeature.hooks")]


def test_every_feature_is_a_package_with_its_entry():
    """Each package of FEATURE_PACKAGES has its entry (feature.py's FEATURE), named as its package."""
    from ds_exp.config.features import features

    assert [f"ds_exp.{f.name}" for f in features()] == list(FEATURE_PACKAGES)
    for name in FEATURES:
        assert (PACKAGE / name / "feature.py").is_file(), f"ds_exp/{name}/feature.py holds the feature's entry"


WHOLE_CONFIG_LIMIT = 40  # issue 38: a feature is handed its own settings, not the whole Config


def takes_the_whole_config(source: str) -> list[str]:
    """The functions with a parameter annotated `Config` (ds_exp.config.schema's), by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if any(p.annotation is not None and ast.unparse(p.annotation).strip("'\"") == "Config" for p in params):
                found.append(node.name)
    return found


def test_few_functions_take_the_whole_config():
    sample = "def f(cfg: Config, x: int): ...\ndef g(s: 'Config'): ...\ndef h(t: TrainConfig): ..."
    assert takes_the_whole_config(sample) == ["f", "g"]  # the count below can fail
    taking = [f"{name}.{fn}" for name, path in modules().items() for fn in takes_the_whole_config(path.read_text())]
    assert len(taking) <= WHOLE_CONFIG_LIMIT, "\n".join(taking)


def test_the_folders_are_the_layers():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} - {"assets"}
    assert packages == set(LAYERS) | set(FEATURES)
    for name in set(LAYERS):
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"ds_exp/{name}/__init__.py must say what it owns and what it may import"


def is_light(module: str) -> bool:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FEATURES:  # a feature's entry, settings and checks (and its package)
        return len(parts) == 2 or parts[2] in FEATURE_LIGHT
    return layer_of(module) is not None and parts[1] in LIGHT


def test_light_packages_never_load_torch_or_deepspeed():
    light = sorted(m for m in modules() if is_light(m))
    code = (
        "import importlib, sys\n"
        f"for name in {light!r}:\n"
        "    importlib.import_module(name)\n"
        "from ds_exp import train\n"  # the Python API (ds_exp/train/__init__.py): light until it is called
        "assert callable(train)\n"
        "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_importing_ds_exp_installs_no_hook_and_patches_nothing_of_hydras():
    """No import hook (issue 34: core/lean_imports.py is gone) and no patch of Hydra's composition at import time:
    the hooks are installed where a process composes: main() (prepare_composition), and a submitit job, which
    unpickles its task (cli.HydraTask) and then composes."""
    code = (
        "import pickle, sys\n"
        "from hydra._internal.config_loader_impl import ConfigLoaderImpl as Loader\n"
        "hydra = lambda: (Loader._compose_config_from_defaults_list, Loader.__dict__['_apply_overrides_to_config'])\n"
        "before = list(sys.meta_path), hydra()\n"
        "import ds_exp, ds_exp.launch.cli as cli, ds_exp.config.schema, ds_exp.config.secrets, ds_exp.core.compat\n"
        "print((list(sys.meta_path), hydra()) == before)\n"
        "task = pickle.loads(pickle.dumps(cli.HydraTask()))\n"  # as a submitit job gets it
        "print(task is cli.hydra_task, list(sys.meta_path) == before[0], hydra()[0] is before[1][0])\n"
        "print(all(hasattr(m, '_ds_exp_hooks') for m in (Loader._compose_config_from_defaults_list, "
        "Loader._apply_overrides_to_config)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, check=True)
    assert out.stdout.split() == ["True", "True", "True", "False", "True"], out.stdout + out.stderr


def test_hydras_hooks_say_when_hydra_is_not_a_version_they_were_checked_with():
    from ds_exp.core.compat.hydra import version_problem

    assert version_problem("1.3.2") is None and version_problem("1.3.8") is None
    assert "checked with 1.3.2 to 1.3.8" in (version_problem("1.3.9.dev0") or "")
    assert "install hydra-core==1.3.8" in (version_problem("1.4.0") or "")


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """compat.import_deepspeed_without_mlflow, which the entry points call before the training stack: DeepSpeed's
    autotuner would import all of mlflow (the extra; 1.6 s a process on a quiet 2-core machine)."""
    code = (
        "import sys\n"
        "from ds_exp.core import compat\n"
        "compat.import_deepspeed_without_mlflow()\n"
        "from deepspeed.autotuning import autotuner\n"
        "seen = ('mlflow' in sys.modules, autotuner.has_mlflow)\n"
        "import mlflow.tracking\n"  # the MLflow tracker's import still gets the real package
        "print(*seen, mlflow.tracking.MlflowClient.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, check=True)
    assert out.stdout.splitlines()[-1] == "False False MlflowClient", out.stdout + out.stderr


def test_imports_sit_at_the_top_of_their_module():
    """Heavy modules import what they use at the top; light ones are light by what their package holds, not by
    hiding imports in functions. The exceptions are named with their reason, and ds_exp/core/compat/ (library
    internals, each touched where it is needed so that light callers stay light)."""
    hidden = []
    for name, path in modules().items():
        if name.startswith("ds_exp.core.compat."):
            continue
        tree = ast.parse(path.read_text())
        guarded = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in ast.walk(node)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node in tree.body or id(node) in guarded:
                continue
            what = imported(node)[0]
            if not any(what == ok or what.startswith(ok + ".") for ok in IMPORTED_WHERE_USED):
                hidden.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert hidden == []


def test_private_internals_are_touched_only_in_compat():
    compat = PACKAGE / "core" / "compat"
    touching = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if compat not in p.parents and PRIVATE.search(p.read_text())
    )
    assert touching == []
    assert PRIVATE.search("".join(p.read_text() for p in compat.glob("*.py")))


def test_every_package_is_installed():
    """pyproject.toml lists packages by name: a new one left out works from the checkout (editable install) and is
    missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for root in (PACKAGE, PACKAGE.parent / "hydra_plugins")
        for init in root.rglob("__init__.py")
    }
    assert found - listed == set()


def test_one_lowest_python_is_declared_and_checked():
    """requires-python, ruff's target, mypy's python_version and ds_exp/__init__.py's check name one minimum. mypy
    checks the code against that version's standard library: with 3.10 it finds enum.StrEnum (core/status.py)."""
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    declared = re.fullmatch(r">=\s*3\.(\d+)", project["project"]["requires-python"])
    assert declared, project["project"]["requires-python"]
    minor = declared.group(1)
    assert project["tool"]["ruff"]["target-version"] == f"py3{minor}"
    assert project["tool"]["mypy"]["python_version"] == f"3.{minor}"
    assert re.search(rf"sys\.version_info < \(3, {minor}\)", (PACKAGE / "__init__.py").read_text())


def test_an_older_python_gets_one_line_at_import(monkeypatch):
    import importlib

    import ds_exp

    monkeypatch.setattr(sys, "version_info", (3, 10, 12, "final", 0))
    monkeypatch.setattr(sys, "version", "3.10.12 (main, Nov  6 2024)")
    try:
        importlib.reload(ds_exp)  # the check comes first: nothing after it runs again
    except SystemExit as stop:
        assert str(stop).startswith("ds_exp needs Python 3.11 or newer and this is 3.10.12: see README.md")
    else:
        raise AssertionError("ds_exp imported on Python 3.10")


def test_the_gpu_check_collects_every_gpu_test():
    """bench/gpu_check.py runs `pytest -m gpu` over a fixed list of files (a bare GPU machine lacks the packages
    other test files import): a file gaining a gpu test must join it."""
    from bench.gpu_check import GPU_TEST_FILES

    tests = PACKAGE.parent / "tests"
    gpu_mark = re.compile(r"^\s*(@pytest\.mark\.gpu|pytest\.mark\.gpu,)", re.MULTILINE)
    marked = {str(p.relative_to(PACKAGE.parent)) for p in tests.rglob("test_*.py") if gpu_mark.search(p.read_text())}
    assert marked == set(GPU_TEST_FILES)
