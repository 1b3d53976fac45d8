"""DeepSpeed ops compiled on first use: `ensure_built` builds one before DeepSpeed asks, announcing a compilation; a
failure is one message naming the op, what needs it, the cause and the fix (the compiler's output is in the log)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from deepspeed.accelerator import get_accelerator

from ds_exp.core import compat
from ds_exp.core.errors import RunFailed
from ds_exp.launch.run_logging import FILE_LOGGER
from ds_exp.runtime.build_lock import BuildLockBroken, guard_builds

log = logging.getLogger(__name__)
file_log = logging.getLogger(FILE_LOGGER)

_ARCH = re.compile(r"^(\d+)\.(\d+)[a-z]*(\+PTX)?$")
_building = [0.0]  # seconds this process spent building (or loading) ops: a run's "compile" time


def build_seconds() -> float:
    """Seconds this process spent in `ensure_built` loading ops not loaded yet (a compilation, or a wait for one)."""
    return _building[0]


@dataclass(frozen=True)
class Op:
    builder: str  # DeepSpeed's op builder class
    title: str  # for people
    needed_for: str  # the setting that needs it
    instead: str  # how to do without it


CPU_ADAM = Op(
    "CPUAdamBuilder",
    "DeepSpeed's CPU Adam",
    "optimizer offload (offload.optimizer=cpu/nvme) or optimizer.impl=deepspeed_cpu",
    "use offload=none with optimizer.impl=auto",
)
FUSED_ADAM = Op(
    "FusedAdamBuilder",
    "DeepSpeed's FusedAdam",
    "optimizer.impl=deepspeed_fused or an Adam block in the DeepSpeed config",
    "use optimizer.impl=auto (torch's fused AdamW on CUDA: nothing to compile)",
)
CPU_LION = Op(
    "CPULionBuilder",
    "DeepSpeed's CPU Lion",
    "optimizer=lion with optimizer offload, or optimizer.impl=deepspeed_cpu",
    "use offload=none with optimizer.impl=auto (ds_exp's torch Lion on a CPU)",
)
FUSED_LION = Op(
    "FusedLionBuilder",
    "DeepSpeed's FusedLion",
    "optimizer=lion on CUDA (optimizer.impl=auto or deepspeed_fused)",
    "use optimizer.impl=torch (ds_exp's torch Lion: nothing to compile)",
)
SHM_COMM = Op(
    "ShareMemCommBuilder",
    "DeepSpeed's shared-memory collectives for CPU ranks",
    "DeepSpeed's CPU accelerator",
    "training goes on without them (plain gloo collectives: slower with several ranks)",
)


# the optimizers' ops by builder name (ds_exp/config/optimizers.py names them)
OPS = {op.builder: op for op in (CPU_ADAM, FUSED_ADAM, CPU_LION, FUSED_LION)}


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19 parses it (Hopper's "9.0a" fails, 9.0 runs); None if unchanged."""
    if not value:
        return None
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    fixed = [_ARCH.sub(r"\1.\2\3", e) for e in entries]
    return ";".join(fixed) if fixed != entries else None


@contextlib.contextmanager
def _arch_list_for_deepspeed() -> Iterator[None]:
    original = os.environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = deepspeed_arch_list(original)
    if fixed is None:
        yield
        return
    log.info("TORCH_CUDA_ARCH_LIST=%s: DeepSpeed's op builder cannot parse suffixes, building for %s", original, fixed)
    os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = original  # type: ignore[assignment]  # fixed is None unless set


def ensure_built(op: Op, *, announce: bool) -> None:
    """Load (compiling if needed) `op` now. `announce`: print a notice before a compilation (rank 0)."""
    builder = get_accelerator().create_op_builder(op.builder)
    if builder is None or compat.op_loaded(builder):
        return
    if not builder.is_compatible(verbose=False):
        if op is SHM_COMM:
            return  # DeepSpeed does without it (plain gloo collectives)
        raise RunFailed(
            f"{op.title} ({builder.name}) cannot be built here, and {op.needed_for} needs it: "
            f"{_first_line(str(getattr(builder, 'error_log', None) or 'not compatible'))}; {op.instead}"
        )
    if announce and not compat.op_prebuilt(builder):
        print(
            f"ds_exp: compiling {op.title} ({builder.name}) for {op.needed_for}; the first time with this torch and "
            "DeepSpeed takes about a minute ...",
            file=sys.stderr,
            flush=True,
        )
    guard_builds()  # torch's build lock is build_lock.HeldBaton: told live from stale
    started = time.perf_counter()
    with _arch_list_for_deepspeed():
        try:
            builder.load(verbose=False)
        except BuildLockBroken:
            raise  # one line already: run again
        except Exception as exc:  # a compiler error, a missing toolchain: all end the same way
            file_log.error("building %s failed", builder.name, exc_info=True)
            cause, fix = failure_cause(exc)
            if op is not SHM_COMM:
                needed = f"needed for {op.needed_for}: {cause}. Fix: {fix}; or {op.instead}"
                raise RunFailed(f"could not compile {op.title} ({builder.name}), {needed}") from None
            compat.skip_op(builder)  # an optimization only: DeepSpeed falls back to torch.distributed's own
            if announce:
                print(
                    f"ds_exp: warning: could not compile {op.title} ({builder.name}): {cause}; {op.instead}. "
                    f"Fix: {fix}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            _building[0] += time.perf_counter() - started


def failure_cause(exc: BaseException) -> tuple[str, str]:
    """(what went wrong, how to fix it) from the exception of a failed build."""
    text = str(exc)
    if "--version" in text and "returned non-zero exit status" in text:
        compiler = os.environ.get("CXX", "c++")
        return f"the C++ compiler ({compiler}) does not run", "install g++ (apt-get install g++) or fix CXX"
    if "ninja" in text.lower():
        return "ninja is not installed", "pip install ninja"
    if "nvcc" in text or "CUDA_HOME" in text:
        return (
            "the CUDA compiler (nvcc) was not found",
            "install the CUDA toolkit of torch's CUDA version or set CUDA_HOME",
        )
    if "Error building extension" in text or "error:" in text:
        return (
            f"the compiler failed ({_compiler_error(text)})",
            "check the C++ compiler (g++) and, on GPUs, TORCH_CUDA_ARCH_LIST and nvcc",
        )
    return (_first_line(text) or type(exc).__name__).rstrip("."), "see the log file for the details"


def _compiler_error(text: str) -> str:
    for line in text.splitlines():
        if "error" in line.lower() and "Error building extension" not in line:
            return line.strip()[:200]
    return "see the log file"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""
