"""Shared fixtures: compose the real conf/ tree with Hydra's compose API, run the CLI in a subprocess."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ds_exp.config.paths import conf_dir
from ds_exp.config.precision import detect_accelerator
from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import Config, register_configs, to_config
from tests.real_model import ModelUnavailable, first_layers, smollm2_checkpoint
from tests.training import pin_test_environment

pin_test_environment()  # the user's HF_HUB_OFFLINE, HF_HOME, ...: the tests mean none of them (tests/training.py)

if detect_accelerator() != "cuda":
    # Liger's kernels are Triton kernels: without a GPU only Triton's interpreter runs them (the fused loss's tests,
    # tests/unit/test_fast_path.py). Triton reads this when triton.language is first imported, which torch._dynamo
    # does through transformers' DeepSpeed integration: before any test module imports them. Not in SHELL_ENVIRON:
    # the runs tests start as users would never see it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TIERS_BEYOND_QUICK = ("integration", "system")  # tests/<tier>/: real engines, whole commands, clusters
HEAVIEST_FIRST = {"system": 0, "integration": 1}  # then tests/unit/ (pytest_collection_modifyitems)

# The DeepSpeed ops the tests' runs compile on first use (ds_exp.runtime.ops): every CPU rank's shared-memory
# collectives, and CPU Adam (optimizer offload).
OPS_THE_RUNS_BUILD = ("SHM_COMM", "CPU_ADAM")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which registers "dsession" where workers will start
def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, build the DeepSpeed ops the runs need once, in the controller, before the workers start.

    On a machine whose torch extension cache is empty, the first run of each worker compiles them: two workers
    at once made one compile and the other wait on its lock, saying so on the console ("ds_exp: waiting for the
    build of deepspeed_shm_comm in another process ..."), the minute the build takes twice over on the clock.
    Built here, every run finds them built. One process per op (both cores), through ds_exp's own ensure_built
    (its notice, its lock, its message on failure: the runs that need a failed op then fail on it themselves).
    Without workers (`-n 0`) nothing races: the first run that needs an op builds it. The quick tier trains no
    engine: nothing to build."""
    if not config.pluginmanager.has_plugin("dsession") or config.option.markexpr.strip() == "not slow":
        return
    from tests.training import user_env

    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():  # its notices: seen
        builds = [
            # stdout: DeepSpeed's import-time banner ("Setting accelerator to CPU"), each time; stderr: ds_exp's
            subprocess.Popen([sys.executable, "-c", BUILD_OP, op], env=user_env(), stdout=subprocess.DEVNULL)
            for op in OPS_THE_RUNS_BUILD
        ]
        for proc in builds:
            proc.wait()


BUILD_OP = """
import sys
from ds_exp.core.errors import DsExpError
from ds_exp.runtime import ops
try:
    ops.ensure_built(getattr(ops, sys.argv[1]), announce=True)
except DsExpError as error:  # the runs that need it fail on it, each with this message
    print(f"ds_exp: error: {error}", file=sys.stderr)
"""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the tests' ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The quick tier (`-m "not slow"`) is tests/unit/ without its slow tests: integration and system tests are
    slow by where they live, so a new one cannot slip into the quick tier unmarked.

    Under pytest-xdist (`--dist loadgroup`, pyproject.toml) every test that submits to a SLURM cluster runs in one
    worker, one after another: two workers' jobs would queue behind each other on the one-node cluster, and a
    test's waits (a job's start, the requeue test's signal) would depend on what the other worker submitted. The
    tests that share a module-scoped fixture (the runs a module compares against) run in one worker too:
    each worker builds a module fixture of its own, so tests dealt to both workers ran those runs twice. (What is
    cheap to build, a tokenizer or a data file, is session-scoped instead: each worker builds it once, and the tests
    that use it stay free to go to either worker.)

    The tiers run heaviest first: tests/system/, tests/integration/, then the short tests of tests/unit/. xdist deals
    the groups first (most tests first), then the other tests in this order, to whichever worker is free: a long
    test dealt last kept one worker busy while the other had nothing left (the real model's fine-tunes came last
    of all), and short ones dealt last fill the gaps instead."""
    items.sort(key=lambda item: HEAVIEST_FIRST.get(Path(str(item.fspath)).parent.name, len(HEAVIEST_FIRST)))
    for item in items:
        if Path(str(item.fspath)).parent.name in TIERS_BEYOND_QUICK:
            item.add_marker(pytest.mark.slow)
        if uses_slurm(item):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(Path(str(item.fspath)).stem))


def uses_slurm(item: pytest.Item) -> bool:
    fixtures = getattr(item, "fixturenames", ())
    return "slurm" in fixtures or Path(str(item.fspath)).name.startswith("test_slurm") or "[slurm]" in item.nodeid


def uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "class", "package") for defs in definitions for d in defs)


REPO = Path(__file__).resolve().parents[1]

register_resolvers()
register_configs()


@pytest.fixture
def compose_cfg() -> Callable[..., Config]:
    """The typed config `python -m ds_exp OVERRIDES` trains with (composed by Hydra, then ds_exp's to_config)."""

    def _compose(*overrides: str) -> Config:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return to_config(compose(config_name="config", overrides=list(overrides)))

    return _compose


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenized-data cache for the whole session: runs with the same data settings tokenize once."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF checkpoint dir, built once and cached (see tests/real_model.py)."""
    try:
        return smollm2_checkpoint()
    except ModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_6_layers_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's first 6 of its 30 layers (tests/real_model.py first_layers): 50M parameters."""
    return first_layers(smollm2_dir, tmp_path_factory.mktemp("smollm2_6_layers"), 6)


@pytest.fixture(scope="session")  # session-scoped: the tests that use it stay free to go to either worker
def smollm2_2_layers_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's first 2 of its 30 layers: its whole pretrained embeddings (tied, 49152 rows)."""
    return first_layers(smollm2_dir, tmp_path_factory.mktemp("smollm2_2_layers"), 2)


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python -m ds_exp ARGS` as a user types it, in `cwd` (its outputs/ land there)."""
    from tests.training import user_env
    from tests.zygote import run_python

    return run_python(["-m", "ds_exp", *args], cwd=cwd, env={**user_env(), **(env or {})}, timeout=timeout)


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(size, read_only=False) -> a fresh tmpfs of that size (needs root; skips where not allowed)."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
