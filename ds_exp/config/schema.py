"""Typed schema of the composed config, the base of `conf/config.yaml` in Hydra's ConfigStore: a wrong type, an unknown
key or enum value is rejected at composition. Semantic checks (combinations, ranges, paths): `validate.py`."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from ds_exp.config.fields import (
    FRACTION,
    MAX_SYNTHETIC_ROWS,
    MAX_TIMEOUT_MINUTES,
    MAX_TOKENS,
    SEED,
    Range,
    above,
    at_least,
    setting,
)
from ds_exp.config.optimizer_settings import OptimizerConfig, Owner
from ds_exp.config.optimizers import OPTIMIZERS, register_optimizer_settings
from ds_exp.config.secrets import hide_secrets_when_composing
from ds_exp.config.trackers import LoggerConfig
from ds_exp.core.compat import cache_config_files
from ds_exp.core.errors import ConfigError
from ds_exp.evaluation.settings import HarnessConfig
from ds_exp.exports.settings import ExportSettings
from ds_exp.preference.settings import ObjectiveConfig


def plain(value: object) -> Any:
    """An Enum member's value (what the YAML said), anything else unchanged."""
    return value.value if isinstance(value, Enum) else value


def plain_tree(value: object) -> Any:
    """`plain` all the way down dicts and lists."""
    if isinstance(value, dict):
        return {k: plain_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_tree(v) for v in value]
    return plain(value)


class Launcher(str, Enum):
    auto = "auto"
    single = "single"
    env = "env"  # torchrun / the deepspeed launcher: RANK, WORLD_SIZE, ... already set
    mpi = "mpi"  # mpirun: OMPI_COMM_WORLD_* or PMI_*
    submitit = "submitit"
    slurm = "slurm"  # plain srun


class Backend(str, Enum):
    auto = "auto"
    nccl = "nccl"
    mpi = "mpi"
    ccl = "ccl"
    gloo = "gloo"
    hccl = "hccl"


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Dtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    auto = "auto"


class SchedulerName(str, Enum):
    """Every schedule of transformers.get_scheduler."""

    linear = "linear"
    cosine = "cosine"
    cosine_with_restarts = "cosine_with_restarts"
    polynomial = "polynomial"
    constant = "constant"
    constant_with_warmup = "constant_with_warmup"
    inverse_sqrt = "inverse_sqrt"
    reduce_lr_on_plateau = "reduce_lr_on_plateau"
    cosine_with_min_lr = "cosine_with_min_lr"
    cosine_warmup_with_min_lr = "cosine_warmup_with_min_lr"
    warmup_stable_decay = "warmup_stable_decay"
    greedy = "greedy"


class PromptTemplate(str, Enum):
    raw = "raw"  # the text as given (DeepSpeed-Chat's rows hold the markers): prompt + chosen + eot
    dschat = "dschat"  # " Human: {prompt} Assistant: {chosen}<|endoftext|>"
    chat_template = "chat_template"  # the tokenizer's own chat template
    auto = "auto"  # chat_template when the tokenizer has one, else dschat; raw for rows with the markers


AUTO_SWITCH = "ds_exp.fast_path.checks.fast_path_problems (auto, true or false)"


@dataclass
class ModelConfig:
    name: str = MISSING
    name_or_path: str | None = None  # local directory or hub id; null = build from `arch` (no weights)
    # config kwargs: built from when name_or_path is null, else dry-run planning
    arch: dict[str, Any] | None = setting(None, checked_by="ds_exp.config.model_checks.arch_problems")
    tokenizer: str | None = None  # null = name_or_path, or the tokenizer shipped in ds_exp/assets
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = False
    vocab_multiple: int = setting(
        8, range=Range(1, 65536, fix=" (1 = no padding; the embedding is padded to a multiple of it)")
    )
    attn_implementation: str | None = "auto"  # null = transformers' default; auto: ds_exp/fast_path/attention.py
    liger_kernel: Any = setting("auto", checked_by=AUTO_SWITCH)  # Liger's RMSNorm, SwiGLU, RoPE (ds_exp/fast_path/)
    fused_loss: Any = setting("auto", checked_by=AUTO_SWITCH)  # Liger's fused linear cross-entropy: no full logits
    # transformers' rope_scaling dict (rope_type, factor, ...); Any: a dict merges into null
    rope_scaling: Any = setting(None, checked_by="ds_exp.long_context.checks.rope_scaling_problems")
    tiled_mlp: bool = False  # long context (ds_exp/long_context/): MLPs over sequence tiles, recomputed in backward
    # tiles per MLP call; null = ceil(tokens per row / hidden size)
    tiled_mlp_shards: int | None = setting(None, range=at_least(1, ", or null to derive it"))
    tiled_loss: bool = False  # logits and loss in chunks of tokens: the full tokens x vocabulary logits never exist
    # tokens per chunk; null = about 256 MiB of fp32 logits per chunk
    tiled_loss_tokens: int | None = setting(None, range=at_least(1, ", or null to derive it"))
    activation_offload: bool = False  # checkpointed layer inputs kept in host memory (needs gradient_checkpointing)
    lora_scope: str | None = None  # LoRA's scope when lora.module_name is null (a vision-language model's language
    # model, not its vision tower); null = lora's own default (ds_exp/config/lora_checks.py scope_of)


@dataclass
class DataSource:
    path: str = MISSING  # file, directory (DeepSpeed-Chat layout or save_to_disk) or hub id
    format: str = "auto"  # auto (from the path) | json | jsonl | csv | parquet | arrow | dschat | hub
    layout: str = "auto"  # rows: auto (from the columns) | prompt_chosen | messages | sharegpt | alpaca
    split: str = "train"  # the split trained on, for sources that have splits (save_to_disk dict, hub)
    eval_split: str | None = "auto"  # auto = eval/validation/test when the source has one; null = none
    eval_path: str | None = None  # a separate file (same format) holding this source's eval rows
    prompt_field: str = "prompt"  # column holding the prompt
    chosen_field: str = "chosen"  # column holding the answer trained on
    rejected_field: str | None = "rejected"  # kept for reward-model phases when present; never required
    name: str | None = None  # hub config (subset) name
    revision: str | None = None  # hub revision (branch, tag or commit)


@dataclass
class SyntheticDataConfig:
    # train rows of the embedded task (before data_split)
    num_train: int = setting(4000, range=Range(1, MAX_SYNTHETIC_ROWS, fix=" (or train on your own data: data=local)"))
    # eval rows, drawn from a separate stream and never seen in train; 0 = no eval set
    num_eval: int = setting(200, range=Range(0, MAX_SYNTHETIC_ROWS, fix=" (0 = no eval set)"))
    seed: int = setting(0, range=SEED)  # fixes the task's content; train.seed only shuffles and splits it


@dataclass
class DataConfig:
    name: str = MISSING  # the option picked in conf/data (synthetic, local, dschat_local, blend)
    sources: list[DataSource] = field(default_factory=list)  # blended; empty = the embedded synthetic task
    sft_only_sources: list[DataSource] = field(default_factory=list)  # used whole, no data_split
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)  # used when sources is empty
    data_split: Any = setting(
        "10,0,0", checked_by="ds_exp.data.checks (ds_exp.data.splits.parse_data_split: any spelling of three numbers)"
    )  # phases 1/2/3 proportions, "2,4,4" or [2,4,4] (Any: OmegaConf has no str | list)
    eval_fraction: float = setting(0.05, range=Range(0, 1, high_open=True, fix=", e.g. 0.05"))  # of a phase-1 share
    max_seq_len: int = setting(512, range=Range(1, MAX_TOKENS, fix=", e.g. 512"))  # longer examples are truncated
    template: PromptTemplate = PromptTemplate.dschat  # how a conversation becomes text (docs/data_templates.md)
    end_of_conversation_token: str | None = None  # appended by raw and dschat; null = the eos token
    train_on_prompt: bool = False  # false = prompt tokens get label -100
    packing: bool = False  # concatenate short train examples up to max_seq_len (eval is never packed)
    cache_dir: str | None = None  # tokenized Arrow data; null = one per user: $XDG_CACHE_HOME or ~/.cache, /ds_exp/data
    # tokenization processes; null = 1, or up to 4 for large datasets
    num_proc: int | None = setting(None, range=Range(1, 1024, fix=", or null to decide from the data size"))
    max_eval_examples: int | None = setting(None, range=at_least(1, ", or null for all"))  # after shuffling


ZERO_SIZE = "ds_exp.config.ranges.zero_value_problems: a whole number >= 0, or auto"


@dataclass
class ZeroConfig:
    """DeepSpeed `zero_optimization` keys; null keys are left out of the DeepSpeed config."""

    stage: int = setting(0, range=Range(0, 3, fix=" (zero=stage0 ... zero=stage3)"))
    # bool, or "auto" (= world size > 1: only where there is communication to hide)
    overlap_comm: Any = setting(None, checked_by="ds_exp.config.ranges.zero_value_problems: true, false or auto")
    contiguous_gradients: bool | None = None
    reduce_scatter: bool | None = None
    reduce_bucket_size: Any = setting(None, checked_by=ZERO_SIZE)
    allgather_partitions: bool | None = None
    allgather_bucket_size: Any = setting(None, checked_by=ZERO_SIZE)
    round_robin_gradients: bool | None = None
    sub_group_size: Any = setting(None, checked_by=ZERO_SIZE)
    stage3_prefetch_bucket_size: Any = setting(None, checked_by=ZERO_SIZE)
    stage3_param_persistence_threshold: Any = setting(None, checked_by=ZERO_SIZE)
    stage3_max_live_parameters: Any = setting(None, checked_by=ZERO_SIZE)
    stage3_max_reuse_distance: Any = setting(None, checked_by=ZERO_SIZE)
    stage3_gather_16bit_weights_on_model_save: bool | None = None
    memory_efficient_linear: bool | None = None


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.fp32
    loss_scale: float = setting(0.0, range=at_least(0, " (0 = dynamic loss scaling)"))  # fp16 only
    initial_scale_power: int = setting(
        16, range=Range(0, 64, fix=" (dynamic loss scaling starts at 2^this; DeepSpeed's is 16)")
    )
    loss_scale_window: int = setting(1000, range=at_least(1))
    hysteresis: int = setting(2, range=at_least(1))
    min_loss_scale: float = setting(1.0, range=above(0))


@dataclass
class OffloadConfig:
    optimizer: OffloadDevice = OffloadDevice.none
    param: OffloadDevice = OffloadDevice.none  # ZeRO-3 only
    nvme_path: str | None = None
    pin_memory: bool = True


@dataclass
class LoraConfig:
    dim: int = setting(0, range=at_least(0, " (0 turns LoRA off, e.g. lora.dim=64 turns it on)"))  # LoRA rank
    # scaling = alpha / dim; null = dim (scaling 1, as DeepSpeed-Chat's lora_scaling=1)
    alpha: float | None = setting(None, range=above(0, ", or null for alpha = dim"))
    dropout: float = setting(0.0, range=FRACTION)
    # the adapted Linear layers: inside the scope module_name, those target_modules names (ds_exp/model/lora.py)
    module_name: str | None = None
    target_modules: Any = setting(None, checked_by="ds_exp.config.lora_checks")
    modules_to_save: list[str] = field(default_factory=list)  # trained whole beside the adapters (PEFT's)
    use_dora: bool = False  # PEFT's DoRA: a learned magnitude per output row
    use_rslora: bool = False  # PEFT's rsLoRA: scaling alpha / sqrt(dim) instead of alpha / dim
    quantize: str | None = None  # QLoRA: null | 4bit | 8bit base weights through bitsandbytes (CUDA only)
    only_optimize: bool = True  # freeze everything but the adapters


@dataclass
class SchedulerConfig:
    owner: Owner = Owner.ds_exp
    name: SchedulerName = SchedulerName.cosine
    warmup_steps: int = setting(0, range=at_least(0))
    warmup_ratio: float = setting(0.0, range=FRACTION)  # fraction of the total steps; use either this or warmup_steps
    # scheduler_specific_kwargs of get_scheduler
    kwargs: dict[str, Any] = setting(factory=dict, checked_by="ds_exp.config.schedule_kwargs.scheduler_kwargs_problems")


@dataclass
class TrainConfig(ExportSettings):  # train.export*: ds_exp/exports/settings.py
    micro_batch_size: int = setting(16, range=at_least(1))  # per device
    eval_micro_batch_size: int | None = setting(None, range=at_least(1, " or null"))  # null = micro_batch_size
    gradient_accumulation_steps: int = setting(1, range=at_least(1))
    # int or "auto" (= micro x accumulation x world size)
    global_batch_size: Any = setting("auto", checked_by="ds_exp.config.validate (a positive integer or auto)")
    epochs: int = setting(1, range=at_least(1))
    max_steps: int = setting(-1, range=at_least(-1, " (-1 = use train.epochs)"))  # > 0 overrides epochs
    gradient_clipping: float = setting(1.0, range=at_least(0, " (0 = no clipping)"))
    seed: int = setting(1234, range=SEED)
    # optimizer steps between metric lines (and DeepSpeed's steps_per_print); 0: ds_config.log_interval
    log_every: int = setting(0, range=at_least(0, " (0 = about 50 metric lines a run)"))
    eval_every: int = setting(0, range=at_least(0))  # 0 = only before training, after each epoch and at the end
    max_evals: int = setting(5, range=at_least(1))  # with eval_every=0: evaluations after the start at most
    eval_at_start: bool = True
    save_every: int = setting(0, range=at_least(0))  # 0 = only at the end
    keep_last: int = setting(2, range=at_least(0))  # checkpoints kept
    save_final_checkpoint: bool = True
    checkpoint_dir: str = "checkpoints"  # relative to the run directory
    allow_outside_run_dir: bool = False  # let checkpoint_dir / export_dir point outside the run directory
    max_bad_steps: int = setting(10, range=at_least(0))  # consecutive non-finite losses before giving up
    compile: Any = setting("auto", checked_by=AUTO_SWITCH)  # torch.compile of each decoder layer (auto: CUDA, ZeRO 0-2)
    peak_tflops: float | None = setting(None, range=above(0, ", or null for the GPU's own"))  # per device, for MFU


@dataclass
class DistConfig:
    launcher: Launcher = Launcher.auto
    backend: Backend = Backend.auto
    timeout_minutes: int = setting(
        30,
        range=Range(
            1,
            MAX_TIMEOUT_MINUTES,
            fix=" (a year; torch counts the timeout in nanoseconds and longer ones overflow); the default is 30",
        ),
    )
    master_port: int = setting(29500, range=Range(1, 65535, fix=" (a TCP port, e.g. 29500)"))
    # Ulysses sequence parallelism (DeepSpeed's ALST): N ranks train each sample together, sharded along the
    # sequence; world size = data-parallel x N, global batch = micro x accumulation x data-parallel
    sequence_parallel_size: int = setting(
        1, range=at_least(1, " (1 = off; N > 1 shards every sample's sequence over N ranks)")
    )  # ds_exp/sequence_parallel/


@dataclass
class DeepSpeedSection:
    config_file: str | None = None  # an existing DeepSpeed JSON (Hugging Face / Axolotl style, "auto" allowed)
    config: dict[str, Any] = setting(
        factory=dict, checked_by="ds_exp.config.ds_config (built from the groups; a user's file is DeepSpeed's to read)"
    )  # built from the groups by interpolation


@dataclass
class EvalConfig:
    prompts: list[str] = field(default_factory=list)  # completed at the first and the last evaluation
    prompts_file: str | None = None  # more prompts: one per line, or JSON lines with a "prompt" field
    max_new_tokens: int = setting(64, range=Range(1, MAX_TOKENS))
    every_eval: bool = False  # also at every evaluation in between
    temperature: float = setting(0.0, range=at_least(0, " (0 = greedy, e.g. 0.7 to sample)"))  # 0 = greedy; > 0 samples
    top_p: float = setting(1.0, range=Range(0, 1, low_open=True, fix=" (1 = off)"))  # nucleus sampling
    top_k: int = setting(0, range=at_least(0, " (0 = off)"))  # sample among the k likeliest tokens; 0 = off
    seed: int = setting(1234, range=SEED)  # seeds each generation's sampling (training's random state is kept)
    harness: HarnessConfig = field(default_factory=HarnessConfig)  # lm-eval scores of the export: ds_exp/evaluation/


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # its option's settings class (optimizers.py)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # the trackers' settings: ds_exp/config/trackers.py
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # sft | dpo | reward: ds_exp/preference/
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    experiment_name: str = "default"
    dry_run: bool = False
    resume: str | None = None  # null | auto | path to a checkpoint directory


_SOURCE_PATH = re.compile(r"(data\.(?:sources|sft_only_sources)\[\d+\])\.path")


def path_not_set(key: str) -> str:
    """A data source's unset path, said with the override that sets it."""
    hint = key.replace("[", ".").replace("]", "")  # Hydra override syntax: data.sources.0.path
    return f"{key}.path is not set; set it to a data file, a directory or a hub id (e.g. {hint}.path=/data/x.jsonl)"


def to_config(cfg: Any) -> Config:
    """The composed config as typed objects, once, at the entry point (Hydra's own node left out)."""
    if "hydra" in cfg:
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # mandatory values (???) left unset: one line each, naming the key (a source path: what to put there)
        matches = [(key, _SOURCE_PATH.fullmatch(key)) for key in missing]
        raise ConfigError(
            [path_not_set(m.group(1)) if m else f"{key} is not set: give it a value ({key}=...)" for key, m in matches]
        )
    typed: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    typed.deepspeed.config = plain_tree(typed.deepspeed.config)
    return typed


def schema_for(saved: Any = None) -> DictConfig:
    """The schema to merge a saved config into, `optimizer` typed by the optimizer `saved` names (adamw by default)."""
    node = OmegaConf.structured(Config)
    chosen = saved.get("optimizer") if isinstance(saved, (dict, DictConfig)) else None
    name = str(chosen.get("name") or "adamw") if isinstance(chosen, (dict, DictConfig)) else "adamw"
    entry = OPTIMIZERS.get(name, OPTIMIZERS["adamw"])
    node.optimizer = OmegaConf.structured(entry.settings(name=entry.name))
    return node


def as_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain JSON values (for wandb, secret scanning)."""
    return plain_tree(asdict(cfg))


def register_configs() -> None:
    """Make the schema the base of conf/config.yaml (its defaults list starts with `ds_exp_schema`)."""
    store = ConfigStore.instance()
    store.store(name="ds_exp_schema", node=Config)
    register_optimizer_settings(store)  # the base of each conf/optimizer/<name>.yaml
    hide_secrets_when_composing()  # literal credentials in config files never reach what Hydra saves
    cache_config_files()  # each file parsed once per process, not once per composition
