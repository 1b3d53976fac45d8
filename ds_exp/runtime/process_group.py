"""How the process was launched (`detect_launch`: the environment only), the launch variables filled where the launcher
did not set them (`export_launch_env`), and distributed initialisation."""

from __future__ import annotations

import atexit
import datetime
import gc
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ds_exp.config.schema import DistConfig, plain
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError
from ds_exp.launch.environment import LaunchInfo, choose_backend, cpu_threads_per_rank, export_launch_env
from ds_exp.launch.rendezvous import wait_for_rendezvous
from ds_exp.runtime import ops
from ds_exp.runtime.rank_logging import library_stdout


def init_distributed(dist_cfg: DistConfig, launch: LaunchInfo, accelerator: str) -> str:
    """Export the launch variables and start torch.distributed through DeepSpeed; returns the backend."""
    export_launch_env(launch)
    threads = cpu_threads_per_rank(launch)
    if threads is not None:
        torch.set_num_threads(threads)
    backend = choose_backend(plain(dist_cfg.backend), accelerator)
    check_backend(backend, accelerator)
    if not dist.is_initialized():
        atexit.register(release_process_groups)
        if accelerator == "cpu":
            # DeepSpeed compiles this inside init_distributed: build it first, with a notice and a clear failure
            ops.ensure_built(ops.SHM_COMM, announce=launch.rank == 0)
    with library_stdout():  # DeepSpeed prints per rank ("... built successfully"): to the log
        wait_for_rendezvous(
            lambda: deepspeed.init_distributed(
                dist_backend=backend,
                auto_mpi_discovery=False,  # the variables are exported above, from whichever launcher it was
                distributed_port=launch.master_port,
                timeout=datetime.timedelta(minutes=int(dist_cfg.timeout_minutes)),
                verbose=False,
            ),
            launch,
            int(dist_cfg.timeout_minutes),
        )
    if accelerator == "cuda":
        get_accelerator().set_device(launch.local_rank)
    return backend


def check_backend(backend: str, accelerator: str) -> None:
    """dist.backend must exist in this torch and fit the device: told now, not as a C++ error at rendezvous."""
    available = {
        "nccl": dist.is_nccl_available() and accelerator == "cuda",
        "mpi": dist.is_mpi_available(),
        "gloo": dist.is_gloo_available(),
    }
    why = {
        "nccl": "needs NVIDIA GPUs and a CUDA build of torch",
        "mpi": "needs a torch built with MPI (pip's builds are not)",
        "gloo": "is not in this torch build",
    }
    if backend in available and not available[backend]:
        raise ConfigError(f"dist.backend={backend} {why[backend]}; use dist.backend=auto (gloo on CPUs, nccl on GPUs)")
    if backend == "ccl":
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            raise ConfigError(
                "dist.backend=ccl needs Intel's oneCCL bindings (pip install oneccl_bind_pt); or dist.backend=auto"
            ) from None


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Collective: `values` summed over ranks (float64), back on the host."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast(value: Any) -> Any:
    """Collective: rank 0's `value` on every rank (a picklable object)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


# What the backends say when the other end of a collective is gone (its process died or was killed).
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "communicator was aborted",
    "remote process exited",
)
_lost_peer = False


def is_lost_peer(exc: BaseException) -> bool:
    """Whether `exc` says that another rank went away in the middle of a collective."""
    text = str(exc).lower()
    return isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(s in text for s in _PEER_GONE)


def mark_lost_peer() -> None:
    """A rank is gone: tearing the process group down at exit could wait on it, so skip that."""
    global _lost_peer
    _lost_peer = True


def release_process_groups() -> None:
    """Free the groups before interpreter teardown, which could otherwise abort a finished rank (SIGABRT)."""
    if dist.is_initialized() and not _lost_peer:
        dist.destroy_process_group()
        compat.forget_deepspeed_groups(dist.ProcessGroup)
        gc.collect()  # what still held the groups in cycles (an engine's hooks), and with it the groups
