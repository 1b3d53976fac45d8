"""The optimizers, one table: each entry owns its facts (what `optimizer=<name>` builds and how, its settings, state
bytes per parameter, where it runs), and everything else reads them. Combined checks: optimizer_checks.py; building:
ds_exp/model/optimizers.py. Light: no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore

from ds_exp.config.components import Component, table
from ds_exp.config.optimizer_settings import (
    AdafactorConfig,
    Adam8bitConfig,
    AdamConfig,
    LionConfig,
    MuonConfig,
    OptimizerConfig,
    OptimizerImpl,
    Owner,
    SGDConfig,
)


@dataclass(frozen=True)
class Impl:
    """One way to build an optimizer: its class, fixed keyword arguments, and what it needs."""

    builder: str  # "package.module:Class"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    op: str | None = None  # the DeepSpeed op compiled before it is built (ds_exp/runtime/ops.py)
    cuda: bool = False  # runs on a CUDA device only
    host: bool = False  # updates parameters in host memory: the one an offloaded optimizer step runs


@dataclass(frozen=True)
class OptimizerEntry(Component):
    settings: type[OptimizerConfig] = OptimizerConfig
    when: str = ""  # one line: when to pick it (README, --help)
    # the builder's (and DeepSpeed's) keyword -> the setting it takes (several: a tuple of their values)
    arguments: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    # fp32 optimizer state per trainable parameter, from the settings and the impl built ("" for entries without)
    state_bytes: Callable[[Any, str], float] = lambda settings, impl: 8.0
    aux_state_bytes: float | None = None  # per parameter it hands to an auxiliary AdamW (muon: embeddings, norms)
    impls: Mapping[str, Impl] = field(default_factory=dict)  # optimizer.impl -> how (empty: `builder`, no impl)
    cuda_impl: str = "torch"  # what impl=auto builds on a CUDA device (offload: the impl whose `host` is set)
    deepspeed_type: str | None = None  # the "optimizer" block's type when DeepSpeed builds it
    deepspeed_params: Mapping[str, Any] = field(default_factory=dict)  # fixed params of that block
    owners: tuple[Owner, ...] = (Owner.ds_exp, Owner.deepspeed)  # who may build it
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    zero_note: str = ""  # why the stages it lacks are refused
    offload_note: str | None = None  # None: optimizer offload runs it; else why it cannot
    universal: bool = False  # DeepSpeed's universal checkpoints carry its state (a resume with another layout)
    zero_untested: bool = False  # DeepSpeed's ZeRO needs zero_allow_untested_optimizer to take it
    cuda_only: bool = False  # runs on CUDA GPUs only
    deepspeed_cuda: bool = False  # DeepSpeed builds it on CUDA, or under optimizer offload, only
    clip_note: str | None = None  # why it refuses gradient clipping at ZeRO stages 1-3 (None: it does not)
    zero3_settings: Mapping[str, tuple[Any, str]] = field(default_factory=dict)  # DeepSpeed path -> (value, why)
    compiled_update: bool = False  # DeepSpeed torch.compiles its update: run eagerly on a CPU (model/optimizers.py)

    @property
    def offload(self) -> bool:
        return self.offload_note is None

    def impl_for(self, settings: OptimizerConfig, *, offload: bool, accelerator: str) -> str:
        """optimizer.impl with auto decided ("" for an entry built one way only)."""
        if not self.impls:
            return ""
        impl = getattr(settings, "impl", OptimizerImpl.auto)
        chosen = str(impl.value if isinstance(impl, Enum) else impl)
        if chosen != "auto":
            return chosen
        if offload:
            return next(name for name, way in self.impls.items() if way.host)
        return self.cuda_impl if accelerator == "cuda" else "torch"

    def how(self, impl: str) -> Impl:
        return self.impls[impl] if impl else Impl(self.builder)

    def values(self, settings: OptimizerConfig) -> dict[str, tuple[Any, str]]:
        """Each argument's value from the settings, as JSON values: keyword -> (value, "optimizer.<key>")."""
        out = {}
        for argument, keys in self.arguments.items():
            names = (keys,) if isinstance(keys, str) else keys
            found = [_json_value(getattr(settings, key)) for key in names]
            out[argument] = (found[0] if isinstance(keys, str) else found, ", ".join(f"optimizer.{k}" for k in names))
        return out

    def kwargs(self, settings: OptimizerConfig) -> dict[str, Any]:
        """The builder's keyword arguments (lists as tuples: betas)."""
        return {k: tuple(v) if isinstance(v, list) else v for k, (v, _) in self.values(settings).items()}

    def deepspeed_block(self) -> dict[str, Any]:
        """The DeepSpeed config's "optimizer" block when DeepSpeed builds it, its values "auto"."""
        params = {**dict.fromkeys(self.arguments, "auto"), **self.deepspeed_params}
        return {"type": self.deepspeed_type, "params": params}

    def deepspeed_settings(self, stage: object) -> dict[str, tuple[Any, str]]:
        """DeepSpeed keys this optimizer needs at ZeRO `stage`: path -> (value, why)."""
        needs: dict[str, tuple[Any, str]] = {}
        if self.zero_untested and stage in (1, 2, 3):
            needs["zero_allow_untested_optimizer"] = (True, f"DeepSpeed's ZeRO has not tested {self.name}")
        if stage == 3:
            needs.update(self.zero3_settings)
        return needs


def _json_value(value: object) -> Any:
    if isinstance(value, Enum):
        return value.value
    return list(value) if isinstance(value, (list, tuple)) else value


ADAM_ARGUMENTS = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}


def _adam(adamw: bool, when: str, **more: Any) -> OptimizerEntry:
    """adamw or adam: the same four builds, with decoupled weight decay or with L2 in the gradient."""
    torch_class = "torch.optim:AdamW" if adamw else "torch.optim:Adam"
    return OptimizerEntry(
        name="adamw" if adamw else "adam",
        builder=torch_class,
        settings=AdamConfig,
        when=when,
        arguments=ADAM_ARGUMENTS,
        impls={
            "torch": Impl(torch_class),
            "torch_fused": Impl(torch_class, {"fused": True}),
            "deepspeed_fused": Impl("deepspeed.ops.adam:FusedAdam", {"adam_w_mode": adamw}, op="FusedAdamBuilder"),
            "deepspeed_cpu": Impl(
                "deepspeed.ops.adam:DeepSpeedCPUAdam", {"adamw_mode": adamw}, op="CPUAdamBuilder", host=True
            ),
        },
        cuda_impl="torch_fused",
        deepspeed_type="AdamW" if adamw else "Adam",
        universal=True,
        **more,
    )


OPTIMIZERS: dict[str, OptimizerEntry] = table(
    [
        _adam(True, "the default: fine-tuning and pretraining alike, every ZeRO stage, offload, universal checkpoints"),
        _adam(
            False,
            "Adam with L2 weight decay in the gradient (the original), to reproduce a recipe that used it",
            deepspeed_params={"adam_w_mode": False},
        ),
        OptimizerEntry(
            name="lion",
            builder="ds_exp.model.lion:Lion",
            settings=LionConfig,
            when="half of AdamW's optimizer memory (one moment); wants a 3-10x smaller learning rate",
            arguments={"lr": "lr", "betas": "betas", "weight_decay": "weight_decay"},
            # one moment; DeepSpeed's CPU Lion also allocates a second one it never uses
            state_bytes=lambda settings, impl: 8.0 if impl == "deepspeed_cpu" else 4.0,
            impls={
                "torch": Impl("ds_exp.model.lion:Lion"),
                "deepspeed_fused": Impl("deepspeed.ops.lion:FusedLion", op="FusedLionBuilder", cuda=True),
                "deepspeed_cpu": Impl("deepspeed.ops.lion:DeepSpeedCPULion", op="CPULionBuilder", host=True),
            },
            cuda_impl="deepspeed_fused",
            deepspeed_type="Lion",
            deepspeed_cuda=True,  # DeepSpeed builds FusedLion, or its CPU Lion under offload
            zero_untested=True,  # ds_exp's torch Lion (DeepSpeed's own two are tested)
        ),
        OptimizerEntry(
            name="adafactor",
            builder="torch.optim:Adafactor",
            settings=AdafactorConfig,
            when="the least optimizer memory (factored second moments, no first): large models at ZeRO stage 0",
            arguments={
                "lr": "lr",
                "beta2_decay": "beta2_decay",
                "eps": ("eps", "eps_scale"),  # torch's eps pair
                "d": "d",
                "weight_decay": "weight_decay",
            },
            # a row and a column per matrix: a few bytes per thousand parameters
            state_bytes=lambda settings, impl: 0.0,
            deepspeed_type="Adafactor",
            zero_stages=(0,),
            zero_note=(
                "Adafactor factors each matrix's second moment and scales each step by the matrix's RMS, but ZeRO "
                "stages 1-3 hand the optimizer flat partitions of every parameter: no factoring, and steps that "
                "depend on the world size"
            ),
            offload_note="DeepSpeed runs an offloaded optimizer step only with its CPU Adam or CPU Lion",
            zero_untested=True,
        ),
        OptimizerEntry(
            name="sgd",
            builder="torch.optim:SGD",
            settings=SGDConfig,
            when="ablations and baselines: SGD with momentum (nesterov optional), one buffer per parameter",
            arguments={"lr": "lr", "momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay"},
            state_bytes=lambda settings, impl: 4.0 if settings.momentum > 0 else 0.0,
            deepspeed_type="SGD",
            offload_note="DeepSpeed runs an offloaded optimizer step only with its CPU Adam or CPU Lion",
            zero_untested=True,
        ),
        OptimizerEntry(
            name="muon",
            builder="deepspeed.runtime.zero.muon.muon_optimizer:MuonWithAuxAdam",
            settings=MuonConfig,
            when="pretraining-style runs: orthogonalized momentum for hidden matrices, AdamW for the rest",
            arguments={k: k for k in ("lr", "momentum", "ns_method", "adam_lr", "betas", "eps", "weight_decay")},
            state_bytes=lambda settings, impl: 4.0,  # one momentum per matrix entry
            aux_state_bytes=8.0,  # AdamW's two moments for embeddings, the head, norms and biases
            deepspeed_type="muon",
            deepspeed_params={"torch_adam": True},  # the auxiliary AdamW is torch's: nothing to compile
            owners=(Owner.deepspeed,),
            offload_note="DeepSpeed's Muon diverges with CPU offload (DeepSpeed RFC #8463)",
            clip_note=(
                "DeepSpeed 0.19.8 clips Muon's orthogonalized update there, not the gradient, which shrinks every "
                "step to the clipping norm (Muon's updates are normalized by construction)"
            ),
            zero3_settings={
                "zero_optimization.reduce_scatter": (
                    False,
                    "DeepSpeed's Muon at ZeRO stage 3 does not run with reduce-scatter",
                )
            },
            compiled_update=True,
        ),
        OptimizerEntry(
            name="adamw_8bit",
            builder="bitsandbytes.optim:AdamW8bit",
            packages=("bitsandbytes",),
            extra="bitsandbytes",
            settings=Adam8bitConfig,
            when="AdamW with 8-bit moments: a quarter of its optimizer memory, on CUDA GPUs (bitsandbytes)",
            arguments=ADAM_ARGUMENTS,
            state_bytes=lambda settings, impl: 2.0,
            owners=(Owner.ds_exp,),
            offload_note="DeepSpeed runs an offloaded optimizer step only with its CPU Adam or CPU Lion",
            zero_untested=True,
            cuda_only=True,
        ),
    ]
)


def entry_of(settings: OptimizerConfig) -> OptimizerEntry | None:
    """The entry whose settings these are (None: an unknown name, or another optimizer's settings)."""
    entry = OPTIMIZERS.get(str(settings.name))
    return entry if entry is not None and type(settings) is entry.settings else None


def entry_for_deepspeed_type(block_type: object) -> OptimizerEntry | None:
    """The entry DeepSpeed builds for an "optimizer" block's type (case as DeepSpeed reads it: lower for its own)."""
    wanted = str(block_type).lower()
    return next((e for e in OPTIMIZERS.values() if e.deepspeed_type and e.deepspeed_type.lower() == wanted), None)


def register_optimizer_settings(store: ConfigStore) -> None:
    """Each entry's settings as `optimizer_settings/<name>`, the base of conf/optimizer/<name>.yaml."""
    for entry in OPTIMIZERS.values():
        store.store(group="optimizer_settings", name=entry.name, node=entry.settings)
