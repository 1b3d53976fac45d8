"""DeepSpeed's internals ds_exp relies on (0.19.8): its op cache, ZeRO-3's partitions and module stack, the checkpoint
reader, the universal-checkpoint converter and loader, the stage-0 gradient norm, its process groups, and its eager
import of mlflow."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_exp.core.compat.torch import extension_build_dir


def op_loaded(builder: Any) -> bool:
    """Whether DeepSpeed already holds this op's module in memory.

    DeepSpeed 0.19.8: `OpBuilder._loaded_ops` (a class-level dict keyed by op name) caches loaded modules, so an
    op ds_exp built is not loaded again when DeepSpeed asks for it. If it disappears, ops are merely loaded twice
    (fast: the compiled library is on disk)."""
    return builder.name in getattr(type(builder), "_loaded_ops", {})


def skip_op(builder: Any) -> None:
    """Make DeepSpeed treat this op as unavailable on this machine.

    DeepSpeed 0.19.8: `deepspeed.ops.__compatible_ops__` (a module-level dict, op name -> bool) is what
    `comm.torch.build_shm_op` consults before building the CPU shared-memory op; False makes it return None and
    the CPU backend uses torch.distributed's collectives. If the dict goes away, DeepSpeed would try the build
    itself and fail with its own traceback."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[builder.NAME] = False


def op_prebuilt(builder: Any) -> bool:
    """Whether loading this op needs no compilation: installed with DeepSpeed (DS_BUILD_OPS=1), or compiled
    before into torch's extension directory."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.name, False):
        return True
    return (extension_build_dir(builder.name) / f"{builder.name}.so").is_file()


def zero3_full_state_dict(engine: Any) -> dict[str, Any] | None:
    """Collective: the full (unpartitioned) state dict on rank 0, gathered layer by layer, None elsewhere.

    DeepSpeed 0.19.8: `DeepSpeedEngine._zero3_consolidated_16bit_state_dict()` (what its public
    save_16bit_model uses, but returning the dict instead of writing a file). It keeps each tensor's dtype. If it
    changes, the export at ZeRO-3 fails with an AttributeError naming it."""
    return engine._zero3_consolidated_16bit_state_dict()


def local_weight_shards(engine: Any) -> Iterator[Any]:
    """This rank's own copy of each weight: at ZeRO-3 its partition, else the parameter itself.

    DeepSpeed 0.19.8: a ZeRO-3 parameter is an empty placeholder outside a gather; `param.ds_tensor` holds the
    rank's partition. If the attribute is renamed, this raises on an empty parameter without it (every ZeRO-3 run
    checks its end state, ds_exp/divergence.py) instead of passing weights it cannot see."""
    for param in engine.module.parameters():
        shard = getattr(param, "ds_tensor", None)
        if shard is None and param.numel() == 0 and hasattr(param, "ds_id"):
            raise RuntimeError("compat.local_weight_shards: a ZeRO-3 parameter without `ds_tensor` (DeepSpeed changed)")
        yield param.detach() if shard is None else shard


def read_checkpoints_weights_only(engine: Any, allowed: list[Any]) -> None:
    """Make DeepSpeed read checkpoint files with torch.load(weights_only=True), allowing only `allowed` types.

    DeepSpeed 0.19.8: `engine.checkpoint_engine.load(path, map_location)` is how every checkpoint file is read (with
    weights_only=False: a pickle runs whatever it says); ds_exp replaces that attribute on the engine. If the name
    changes, this assignment is silently unused and a resume would read with DeepSpeed's own unsafe load: the
    tampered-checkpoint test (tests/integration/test_security.py) catches that."""
    import torch

    def safe_load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = safe_load


UNIVERSAL_CHECKED = "0.19.8"  # the DeepSpeed version ds_exp's universal-checkpoint handling was checked against


def check_universal_version() -> str | None:
    """A warning when the installed DeepSpeed is not the one the universal-checkpoint handling below (and the file
    layout fixes in ds_exp/checkpoint/conversion.py) was checked against; None when it is."""
    import deepspeed

    if deepspeed.__version__.split("+")[0] == UNIVERSAL_CHECKED:
        return None
    return (
        f"resume: converting checkpoints to DeepSpeed's universal format was checked with DeepSpeed "
        f"{UNIVERSAL_CHECKED}, this is {deepspeed.__version__}: compare the resumed losses with the run's before "
        "trusting them"
    )


def ds_to_universal(input_folder: Path, output_folder: Path, workers: int) -> None:
    """DeepSpeed's converter, called in this process (its command line is `python -m ...ds_to_universal`).

    DeepSpeed 0.19.8: `deepspeed.checkpoint.ds_to_universal.main(args)` reads these attributes of an argparse
    namespace. `inject_missing_state` is needed for models without Megatron's universal_checkpoint_info (all of
    ds_exp's). If an attribute is renamed, the conversion fails with an AttributeError naming it."""
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
    """Undo two things DeepSpeed's ZeRO-3 universal loader gets wrong for a torch optimizer.

    DeepSpeed 0.19.8, `DeepSpeedZeroOptimizer_Stage3._load_universal_checkpoint`: every fp32 partition's optimizer
    state gets one shared `step` tensor (torch's AdamW then advances it once per sub-group, and the losses drift by
    ~1e-4), and param group 0's hyperparameters (weight decay) are copied to every group. `engine.optimizer.optimizer`
    is the wrapped torch optimizer. If this stops applying, tests/integration/test_resume_anywhere.py's ZeRO-3
    comparison fails."""
    import torch

    base = engine.optimizer.optimizer
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for group, values in zip(base.param_groups, param_groups, strict=True):
        group.update({k: v for k, v in values.items() if k != "params"})


def keep_fp32_grad_norm(engine: Any) -> None:
    """Make `engine.get_global_grad_norm()` answer at ZeRO stage 0 in fp32 too (metric lines' grad_norm).

    DeepSpeed 0.19.8: without ZeRO, fp16 or bf16, `DeepSpeedEngine._take_model_step` clips with
    `engine.clip_fp32_gradients()`, which computes the pre-clip global norm with `runtime.utils.clip_grad_norm_`
    and drops it; `get_global_grad_norm()` returns `engine._global_grad_norm`, which only ZeRO / 16-bit optimizers
    fill. The replacement below runs the same call and keeps its result there, so nothing is computed twice. If
    either name changes, grad_norm is null again at stage 0 (tests/integration/test_parity.py's stage-0 case catches
    it)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep_norm() -> None:
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_keep_norm


def release_sequence_parallel_groups() -> None:
    """Forget DeepSpeed's sequence-parallel groups, so that `register_with_transformers` can make them again in the
    same process (it asserts they were never made: a multirun runs several jobs in one process).

    DeepSpeed 0.19.8: `parallel_state_sp._release_sequence_parallel_groups()` clears its two module globals (DeepSpeed
    calls it itself only when the world group is destroyed), and `deepspeed.utils.groups.mpu` holds the mpu the last
    engine was given. If they change, a second sequence-parallel job in one process fails at registration with
    DeepSpeed's "sequence parallel group is already initialized"."""
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if state is not None:
        state._release_sequence_parallel_groups()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "mpu", None) is state:
        vars(groups)["mpu"] = None  # a module attribute DeepSpeed sets at run time


def forget_zero3_module(module: Any) -> None:
    """Let DeepSpeed's ZeRO-3 stack of modules in forward drop this model, whose engine is done.

    DeepSpeed 0.19.8: `runtime.zero.parameter_offload.FWD_MODULE_STACK` (a module-level list) gets the top module
    appended when ZeRO-3's hooks are set up and never removed, not even by `DeepSpeedEngine.destroy()`, and a
    cache (below) holds its submodules: the model, its engine, its optimizer state and the engine's process groups
    live as long as the process. If the names change, they do again (a multirun's next job starts with the last
    one's memory; at exit, gloo's threads outlive the interpreter's shutdown: the launcher test fails)."""
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
    """Drop DeepSpeed's references to process groups that torch.distributed has destroyed, so their backends
    (gloo's threads, NCCL's communicators) are freed now, while the interpreter is whole.

    DeepSpeed 0.19.8: `deepspeed.utils.groups` keeps the groups it made in module globals (`_WORLD_GROUP`, the
    expert, data- and model-parallel groups and their dicts) that nothing clears. A backend freed only during the
    interpreter's own shutdown can abort the process after a completed run (seen: a rank of a 2-rank gloo run
    ended with SIGABRT, "terminate called without an active exception"). If the names change, that is back."""
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
    """What the loss must be multiplied by, beyond undoing DeepSpeed's mean over data-parallel ranks, for the
    gradients to be exact under Ulysses sequence parallelism.

    DeepSpeed 0.19.8 divides a gradient summed over all dp x N ranks by dp (world / N) at ZeRO 0-2 and on ZeRO-3's
    all-reduce path (`stage3.__avg_scatter_contiguous_grads`), but ZeRO-3's reduce-scatter path (`__avg_scatter_grads`
    -> `runtime.comm.coalesced_collectives.reduce_scatter_coalesced`, taken for every bucket when `reduce_scatter` is
    on, its default) divides by the world size: gradients N times too small (measured: safe_get_full_grad halves at
    N=2; Adam hides it, gradient clipping does not). ds_exp refuses zero.reduce_scatter=false under sequence
    parallelism at ZeRO-3 (the two paths would mix per bucket), so the factor is N there. If DeepSpeed fixes it, the
    sequence-parallel parity test at ZeRO-3 (grad_norm compared with one rank's) fails."""
    if sequence_parallel_size <= 1 or engine.zero_optimization_stage() != 3:
        return 1
    return sequence_parallel_size if getattr(engine.optimizer, "reduce_scatter", True) else 1


def import_deepspeed_without_mlflow() -> None:
    """`import deepspeed`, with `import mlflow` failing for its duration: called by the entry points right before
    they import the training stack (ds_exp.launch.cli.run_job, the autotune sweeper, `python -m ds_exp.export`).

    DeepSpeed 0.16-0.19.8: `deepspeed/autotuning/autotuner.py` runs `try: import mlflow` when deepspeed is imported
    (runtime.config -> autotuning.config -> autotuning), for DeepSpeed's own autotuner (`deepspeed --autotuning`,
    which ds_exp never runs: its autotune is hydra/sweeper=autotune). With the mlflow extra installed, that is all of
    mlflow in every rank for nothing: 1.6 s of CPU on a quiet 2-core machine (3 s under load), about 40% of `import
    deepspeed`. Here the autotuner records `has_mlflow = False`; nothing else of DeepSpeed imports mlflow, and
    mlflow is importable again afterwards (ds_exp's MLflow tracker imports it when a run logs to it). A no-op when
    deepspeed or mlflow is imported already. If DeepSpeed imports mlflow elsewhere one day, it finds it missing there
    too (only during this import): tests/unit/test_structure.py checks that this one import is all it affects."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # the import system's "not importable" entry
    try:
        importlib.import_module("deepspeed")
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
