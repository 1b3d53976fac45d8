"""`python -m ds_exp ...` for tests, forked from a process that has imported the training stack once.

A short run of the tiny model spends most of its time importing torch, deepspeed, transformers, peft and datasets
(8.8 s of a 12.8 s run on a loaded 2-core machine, `python -X importtime`). The zygote is one process that imports
them once, then forks a child for each run a test starts: the child is a process of its own, as under
`subprocess.run` (its own pid, stdout, stderr, signal handlers, exit status, atexit handlers, working directory
and environment), that runs the module as `python -m` would, minus those imports.

What a fork cannot give is a different environment at import time: libraries read some variables once on import
(HF_*, DS_ACCELERATOR, OMP_NUM_THREADS, ...). A run whose environment differs in anything but the variables read
at run time (RUNTIME_VARIABLES, RUNTIME_PREFIXES) is forked from another zygote started with its environment
(MAX_ZYGOTES at most: the least recently used idle one gives way), or else a plain subprocess. `run_ranks` forks N
ranks with torchrun's environment; the real launchers (torchrun, the deepspeed launcher, mpirun, SLURM) start
their own interpreters and stay subprocesses. DS_EXP_NO_ZYGOTE=1 turns it off.

Protocol (JSON lines): the test sends {"argv", "cwd", "env", "stdout", "stderr"} on the zygote's stdin; the
zygote answers {"pid"} once forked and {"pid", "returncode"} once the child has ended.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

# Read by ds_exp and the libraries when a run starts, not when they are imported: a difference in these still forks.
RUNTIME_VARIABLES = frozenset({"MASTER_PORT", "PYTHON", "HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE", "LOCAL_RANK"})
RUNTIME_PREFIXES = ("DS_EXP_", "WANDB_", "ACME_", "SLURM_", "SUBMITIT_", "PYTEST_")


class Zygote:
    """The test side: one zygote process per test session, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lock = threading.Lock()
        self.tmp = TemporaryDirectory(prefix="ds_exp_zygote_")
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.tmp.cleanup()

    def _answer(self, timeout: float | None) -> dict | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the test zygote died")
        return json.loads(line)

    def run(
        self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float | None, ranks: int = 1
    ) -> subprocess.CompletedProcess:
        """Like subprocess.run([sys.executable, *argv], cwd=, env=, capture_output=True, text=True, timeout=);
        with `ranks` > 1, like torchrun starting that many (see torchrun_ranks)."""
        if not Path(cwd).is_dir():
            raise FileNotFoundError(f"no such directory: {cwd}")
        with self.lock:
            out, err = Path(self.tmp.name) / "stdout", Path(self.tmp.name) / "stderr"
            request = {
                "argv": argv,
                "cwd": str(cwd),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
                "ranks": ranks,
            }
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self._answer(timeout=600)
            if started is None:
                raise RuntimeError("the test zygote did not fork within 600 s (its imports, then the fork)")
            ended = self._answer(timeout)
            timed_out = ended is None
            if timed_out:
                for pid in started["pids"]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                ended = self._answer(None)
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        cmd = [sys.executable, *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout or 0, output=stdout, stderr=stderr)
        assert ended is not None
        return subprocess.CompletedProcess(cmd, ended["returncode"], stdout, stderr)


# one per import-time environment (most runs share one); a new one replaces the least recently used idle one
MAX_ZYGOTES = 3
_zygotes: dict[frozenset[tuple[str, str]], Zygote] = {}


def import_time_environment(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset(
        (k, v) for k, v in env.items() if k not in RUNTIME_VARIABLES and not k.startswith(RUNTIME_PREFIXES)
    )


def run_python(
    argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python ARGV` (`argv` starting with "-m", "<module>"): forked from a zygote where that behaves the same,
    else (or with `fresh`: a test of the whole path, imports included) a plain subprocess."""
    return _run(argv, cwd=cwd, env=env, timeout=timeout, ranks=1, fresh=fresh)


def run_ranks(
    ranks: int, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess | None:
    """`torchrun --nproc_per_node RANKS ARGV` on this node, forked from a zygote; None where no zygote can run it
    (the caller then starts the real launcher)."""
    return _run(argv, cwd=cwd, env=env, timeout=timeout, ranks=ranks)


def _run(
    argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float | None, ranks: int, fresh: bool = False
) -> Any:
    key = import_time_environment(env)
    zygote = _zygotes.get(key)
    if zygote is not None and not zygote.alive():
        zygote.close()
        del _zygotes[key]
        zygote = None
    wanted = argv[:1] == ["-m"] and not fresh and os.environ.get("DS_EXP_NO_ZYGOTE") != "1"
    if not wanted:
        zygote = None
    elif zygote is None:
        idle = [k for k, z in _zygotes.items() if not z.lock.locked()]
        if len(_zygotes) >= MAX_ZYGOTES and idle:  # the least recently used makes room: no worse than a subprocess
            _zygotes.pop(idle[0]).close()
        if len(_zygotes) < MAX_ZYGOTES:
            zygote = _zygotes[key] = Zygote(env)
    if zygote is not None and not zygote.lock.locked():
        _zygotes[key] = _zygotes.pop(key)  # most recently used last
        return zygote.run(argv, cwd=cwd, env=env, timeout=timeout, ranks=ranks)
    if ranks > 1:
        return None
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ---- the zygote's side ----


def torchrun_ranks(env: dict[str, str], ranks: int) -> list[dict[str, str]]:
    """Each rank's environment as torchrun (torch.distributed.run, one node) gives it, less its agent's store: rank 0
    serves the rendezvous store itself, as a rank started by any other env launcher does."""
    port = env.get("MASTER_PORT", "29500")
    common = {
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0",
        "ROLE_WORLD_SIZE": str(ranks),
    }
    common |= {"MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    common |= {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}
    return [{**env, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(ranks)]


def _child(request: dict, env: dict[str, str]) -> None:
    """In the forked child: become `python ARGV` in the request's directory and environment; never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        # the ranks of one launch share its output files, as torchrun's workers share its stdout and stderr
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # read when torch loads, which the zygote did without it
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        module = request["argv"][1]
        sys.argv = [module, *request["argv"][2:]]
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # what the interpreter does at exit: join non-daemon threads, then atexit (logging, wandb, locks)
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code & 0xFF)


# the command line's modules; DeepSpeed's engine (its check of a ZeRO optimizer imports Muon, whose torch.compile
# imports torch._inductor), the ops' loader (torch's cpp_extension), the tiny model's architecture; Hydra's logging
RUNS_IMPORT_LATER = (
    "ds_exp.launch.cli",
    "ds_exp.launch.callbacks",
    "ds_exp.sweeps",
    "ds_exp.train.api",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.runtime.superoffload.superoffload_stage3",
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.ops.op_builder.all_ops",
    "torch._inductor.compile_fx",
    "torch.utils.cpp_extension",
    "transformers.models.llama.modeling_llama",
    "hydra.experimental.callback",
    "hydra._internal.logging_config",
)


def serve() -> None:
    # answers on a descriptor of their own: what the imports print goes to stderr (not into the protocol)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # the training stack (torch, deepspeed, transformers, peft, datasets) and what the dry run adds, deepspeed first
    # as a run imports it (ds_exp.launch.cli.run_job): without all of mlflow; and what every run's first
    # plots/loss.png imports (ds_exp/artifacts/loss_plot.py: a second of matplotlib per run otherwise)
    import matplotlib.backends.backend_agg
    import matplotlib.figure
    import matplotlib.ticker  # noqa: F401

    from ds_exp.core import compat

    compat.import_deepspeed_without_mlflow()
    import ds_exp.tools.dry_run
    import ds_exp.train.recipe  # noqa: F401

    # and what a run imports only once it has started: a forked ZeRO-3 run imported 1,012 more modules, 1.6 s of its
    # 3.8 (the second such run in one process took 2.2 s). None starts a thread (checked: the zygote forks).
    for name in RUNS_IMPORT_LATER:
        with contextlib.suppress(ImportError):  # a module another version of a library does not have
            importlib.import_module(name)
    from hydra.core.plugins import Plugins
    from PIL import Image

    from ds_exp.config.features import features

    features()  # every feature's entry (FEATURE_PACKAGES)
    Plugins.instance()  # Hydra's plugin scan, on a run's first composition
    Image.init()  # PIL's file formats, on plots/loss.png's first save

    gc.freeze()  # the imports' ~550k objects: no collection in a child walks them again (~0.3 s a full one)
    for line in sys.stdin:
        request = json.loads(line)
        ranks = request["ranks"]
        envs = [request["env"]] if ranks == 1 else torchrun_ranks(request["env"], ranks)
        for name in ("stdout", "stderr"):
            Path(request[name]).write_bytes(b"")
        pids = []
        for env in envs:
            for stream in (answers, sys.stdout, sys.stderr):
                stream.flush()
            pid = os.fork()
            if pid == 0:
                answers.close()
                _child(request, env)
            pids.append(pid)
        answers.write(json.dumps({"pids": pids}) + "\n")
        answers.flush()
        answers.write(json.dumps({"pids": pids, "returncode": _wait(pids)}) + "\n")
        answers.flush()


def _wait(pids: list[int]) -> int:
    """One child: its exit status. Several ranks: 0 when all succeed; else, as torchrun, the others are stopped
    (SIGTERM, SIGKILL 30 s later) and the launch fails with 1."""
    if len(pids) == 1:
        return os.waitstatus_to_exitcode(os.waitpid(pids[0], 0)[1])
    left, failed, deadline = set(pids), False, None
    while left:
        if deadline is not None and time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            deadline = None
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        left.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, deadline = True, time.monotonic() + 30
            for other in left:
                os.kill(other, signal.SIGTERM)
    return 1 if failed else 0


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
