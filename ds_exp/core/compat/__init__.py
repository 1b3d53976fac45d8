"""Every touch of a library's private internals, a module per library, each saying the versions it was checked
against and what breaks if the internal changes. Importing this package imports no library and patches nothing."""

# ruff: noqa: F401  (the names below are this package's interface)
from ds_exp.core.compat.deepspeed import (
    UNIVERSAL_CHECKED,
    check_universal_version,
    ds_to_universal,
    fix_zero3_universal_load,
    forget_deepspeed_groups,
    forget_zero3_module,
    import_deepspeed_without_mlflow,
    keep_fp32_grad_norm,
    local_weight_shards,
    op_loaded,
    op_prebuilt,
    read_checkpoints_weights_only,
    release_sequence_parallel_groups,
    sequence_parallel_gradient_factor,
    skip_op,
    zero3_full_state_dict,
)
from ds_exp.core.compat.hydra import (
    basic_sweep_jobs,
    before_overrides,
    cache_config_files,
    hydra_job_callbacks,
    on_compose,
    raise_hydra_errors,
)
from ds_exp.core.compat.liger_kernel import apply_liger_kernels
from ds_exp.core.compat.optuna import optuna_trial_of
from ds_exp.core.compat.submitit import submitit_requeue_signal
from ds_exp.core.compat.torch import compile_seconds, extension_build_dir, torch_load_weights_only, use_extension_baton
from ds_exp.core.compat.transformers import reinit_module
