"""DeepSpeed 0.19.8 internals ds_exp relies on, each in one place, with what breaks if it changes."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_exp.core.compat.torch import extension_build_dir


def op_loaded(builder: Any) -> bool:
    """Whether DeepSpeed already holds this op's module in memory (`OpBuilder._loaded_ops`)."""
    return builder.name in getattr(type(builder), "_loaded_ops", {})


def skip_op(builder: Any) -> None:
    """Make DeepSpeed treat this op as unavailable (the CPU backend then uses torch.distributed's collectives)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[builder.NAME] = False


def op_prebuilt(builder: Any) -> bool:
    """Whether loading this op needs no compilation: installed with DeepSpeed, or compiled before."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.name, False):
        return True
    return (extension_build_dir(builder.name) / f"{builder.name}.so").is_file()


def zero3_full_state_dict(engine: Any) -> dict[str, Any] | None:
    """Collective: the full state dict on rank 0 (each tensor's dtype kept), None elsewhere."""
    return engine._zero3_consolidated_16bit_state_dict()


def local_weight_shards(engine: Any) -> Iterator[Any]:
    """This rank's own copy of each weight: at ZeRO-3 its partition (`ds_tensor`), else the parameter itself."""
    for param in engine.module.parameters():
        shard = getattr(param, "ds_tensor", None)
        if shard is None and param.numel() == 0 and hasattr(param, "ds_id"):
            raise RuntimeError("compat.local_weight_shards: a ZeRO-3 parameter without `ds_tensor` (DeepSpeed changed)")
        yield param.detach() if shard is None else shard


def read_checkpoints_weights_only(engine: Any, allowed: list[Any]) -> None:
    """Make DeepSpeed read checkpoint files with torch.load(weights_only=True), allowing only `allowed` types (its own
    load unpickles anything). The tampered-checkpoint test catches a renamed `checkpoint_engine.load`."""
    import torch

    def safe_load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = safe_load


UNIVERSAL_CHECKED = "0.19.8"  # the DeepSpeed version ds_exp's universal-checkpoint handling was checked against


def check_universal_version() -> str | None:
    """A warning when the installed DeepSpeed is not the one the universal-checkpoint handling was checked against."""
    import deepspeed

    if deepspeed.__version__.split("+")[0] == UNIVERSAL_CHECKED:
        return None
    return (
        f"resume: converting checkpoints to DeepSpeed's universal format was checked with DeepSpeed "
        f"{UNIVERSAL_CHECKED}, this is {deepspeed.__version__}: compare the resumed losses with the run's before "
        "trusting them"
    )


def ds_to_universal(input_folder: Path, output_folder: Path, workers: int) -> None:
    """DeepSpeed's converter in this process (`inject_missing_state`: no Megatron universal_checkpoint_info here)."""
    from deepspeed.checkpoint import ds_to_universal as converter

    converter.main(
        argparse.Namespace(
            input_folder=str(input_folder),
            output_folder=str(output_folder),
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
            num_extract_workers=workers,
            num_merge_workers=max(1, workers // 2),
        )
    )


def fix_zero3_universal_load(engine: Any, param_groups: list[dict[str, Any]]) -> None:
    """Undo DeepSpeed 0.19.8's ZeRO-3 universal loader: one shared `step` tensor for every partition's state (AdamW
    advances it per sub-group) and group 0's hyperparameters copied to every group. test_resume_anywhere catches it."""
    import torch

    base = engine.optimizer.optimizer
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for group, values in zip(base.param_groups, param_groups, strict=True):
        group.update({k: v for k, v in values.items() if k != "params"})


def keep_fp32_grad_norm(engine: Any) -> None:
    """Make `engine.get_global_grad_norm()` answer at ZeRO stage 0 in fp32: DeepSpeed 0.19.8 computes the norm in
    `clip_fp32_gradients` and drops it. tests/integration/test_parity.py's stage-0 case catches a change."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep_norm() -> None:
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_keep_norm


def release_sequence_parallel_groups() -> None:
    """Forget DeepSpeed's sequence-parallel groups (and its mpu), so a multirun's next job can register them again."""
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if state is not None:
        state._release_sequence_parallel_groups()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "mpu", None) is state:
        vars(groups)["mpu"] = None  # a module attribute DeepSpeed sets at run time


def forget_zero3_module(module: Any) -> None:
    """Let ZeRO-3's `FWD_MODULE_STACK` and its coordinator's cache drop this finished model (DeepSpeed 0.19.8 never
    removes it, even in destroy()): else the model, engine and process groups live as long as the process."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    # `PartitionedParameterCoordinator.__params_to_release` is a functools.lru_cache on a method (wrapped by
    # `instrument_w_nvtx`, no functools.wraps): one cache for the class, keyed by every coordinator and submodule
    # it saw. Emptying it costs a live engine one recomputation per submodule.
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    cls = getattr(coordinator, "PartitionedParameterCoordinator", None)
    wrapper = getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None)
    for cell in getattr(wrapper, "__closure__", None) or ():
        clear = getattr(cell.cell_contents, "cache_clear", None)
        if callable(clear):
            clear()


def forget_deepspeed_groups(process_group_type: type) -> None:
    """Drop `deepspeed.utils.groups`' module globals holding destroyed process groups, so their backends are freed
    now: freed only at interpreter shutdown, gloo could abort a completed 2-rank run (SIGABRT)."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    namespace = vars(groups)
    for name, value in list(namespace.items()):
        if isinstance(value, process_group_type):
            namespace[name] = None
        elif isinstance(value, dict) and any(isinstance(v, process_group_type) for v in value.values()):
            value.clear()


def sequence_parallel_gradient_factor(engine: Any, sequence_parallel_size: int) -> int:
    """The loss factor for exact Ulysses gradients: DeepSpeed 0.19.8's ZeRO-3 reduce-scatter divides by the world size
    instead of dp. The ZeRO-3 sequence-parallel parity test catches a fix."""
    if sequence_parallel_size <= 1 or engine.zero_optimization_stage() != 3:
        return 1
    return sequence_parallel_size if getattr(engine.optimizer, "reduce_scatter", True) else 1


def import_deepspeed_without_mlflow() -> None:
    """`import deepspeed` with `import mlflow` failing meanwhile: DeepSpeed 0.16-0.19.8's autotuner imports mlflow
    eagerly (about 40% of the import). tests/unit/test_structure.py checks this is all it affects."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # the import system's "not importable" entry
    try:
        importlib.import_module("deepspeed")
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
