"""The optimizers' typed settings: what conf/optimizer/<name>.yaml carries, one dataclass per kind of optimizer, each
checking its own values (`problems`: one line each, naming the key and the fix). Every optimizer's settings extend
OptimizerConfig, the type of the config's `optimizer` node; the option's YAML names its class in its defaults list
(ds_exp/config/optimizers.py registers them), so Hydra refuses a wrong type or another optimizer's key while it
composes. Which optimizer takes which settings is the table's: ds_exp/config/optimizers.py. Light: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omegaconf import MISSING

from ds_exp.config.fields import (
    FRACTION,
    Range,
    above,
    at_least,
    setting,
)


class Owner(str, Enum):
    ds_exp = "ds_exp"  # built in Python and handed to deepspeed.initialize (DeepSpeed-Chat's convention)
    deepspeed = "deepspeed"  # "optimizer"/"scheduler" blocks of the DeepSpeed config (Hugging Face's convention)


class OptimizerImpl(str, Enum):
    """Which implementation of an Adam or Lion optimizer ds_exp builds (optimizer.owner=ds_exp)."""

    auto = "auto"  # DeepSpeed's CPU op under optimizer offload, the fastest CUDA one on a GPU, torch's otherwise
    torch = "torch"  # torch.optim (Lion: ds_exp's, in torch)
    torch_fused = "torch_fused"  # torch.optim.AdamW(fused=True): no compilation, CUDA and CPU (Adam only)
    deepspeed_fused = "deepspeed_fused"  # DeepSpeed's FusedAdam / FusedLion: a JIT-compiled op (about a minute, once)
    deepspeed_cpu = "deepspeed_cpu"  # DeepSpeed's CPU Adam / CPU Lion: what optimizer offload needs (JIT, once)


class NewtonSchulz(str, Enum):
    gram = "gram"  # DeepSpeed's default: Newton-Schulz on the Gram matrix, about twice as fast
    standard = "standard"  # the original quintic iteration


NO_DECAY = ["bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight"]


@dataclass
class OptimizerConfig:
    """What every optimizer's settings have; each kind's class adds its own."""

    owner: Owner = Owner.ds_exp
    name: str = MISSING  # the option picked in conf/optimizer (its settings class must match)
    lr: float = setting(1e-3, range=above(0))
    weight_decay: float = setting(0.0, range=at_least(0))  # decoupled (AdamW-style) unless the optimizer says otherwise
    no_decay: list[str] = field(default_factory=lambda: list(NO_DECAY))

    def problems(self) -> list[str]:
        found = []
        if self.lr <= 0:
            found.append(f"optimizer.lr={self.lr}: the learning rate must be > 0 (DeepSpeed-Chat uses 1e-3 for SFT)")
        if self.weight_decay < 0:
            found.append(f"optimizer.weight_decay={self.weight_decay}: must be >= 0")
        return found


def _betas(betas: list[float]) -> list[str]:
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        return [f"optimizer.betas={list(betas)}: give two numbers in [0, 1), e.g. [0.9,0.95]"]
    return []


def _eps(eps: float | None) -> list[str]:
    return [f"optimizer.eps={eps}: must be > 0"] if eps is not None and eps <= 0 else []


def _momentum(momentum: float) -> list[str]:
    return [] if 0 <= momentum < 1 else [f"optimizer.momentum={momentum}: must be in [0, 1) (e.g. 0.9)"]


@dataclass
class AdamConfig(OptimizerConfig):
    impl: OptimizerImpl = OptimizerImpl.auto
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], range=FRACTION)
    eps: float = setting(1e-8, range=above(0))

    def problems(self) -> list[str]:
        return super().problems() + _betas(self.betas) + _eps(self.eps)


@dataclass
class Adam8bitConfig(OptimizerConfig):
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], range=FRACTION)
    eps: float = setting(1e-8, range=above(0))

    def problems(self) -> list[str]:
        return super().problems() + _betas(self.betas) + _eps(self.eps)


@dataclass
class LionConfig(OptimizerConfig):
    impl: OptimizerImpl = OptimizerImpl.auto
    lr: float = setting(3e-4, range=above(0))
    betas: list[float] = setting(factory=lambda: [0.9, 0.99], range=FRACTION)

    def problems(self) -> list[str]:
        return super().problems() + _betas(self.betas)


@dataclass
class AdafactorConfig(OptimizerConfig):
    lr: float = setting(
        1e-2, range=above(0)
    )  # torch's Adafactor: the largest relative step (its step is lr x the parameter's RMS)
    beta2_decay: float = setting(-0.8, range=Range(None, 0, fix=" (torch's Adafactor default: -0.8)"))
    eps: float | None = setting(None, range=above(0))  # added to the second moment; null = the dtype's smallest step
    eps_scale: float = setting(1e-3, range=at_least(0))  # the smallest parameter RMS a step is scaled by
    d: float = setting(
        1.0, range=at_least(1, " (the clipping threshold of the update's RMS; torch's default 1.0)")
    )  # clipping threshold of the update's RMS

    def problems(self) -> list[str]:
        found = super().problems() + _eps(self.eps)
        if self.beta2_decay > 0:
            found.append(f"optimizer.beta2_decay={self.beta2_decay}: must be <= 0 (torch's default -0.8)")
        if self.eps_scale < 0:
            found.append(f"optimizer.eps_scale={self.eps_scale}: must be >= 0")
        if self.d < 1:
            found.append(f"optimizer.d={self.d}: the clipping threshold must be >= 1")
        return found


@dataclass
class SGDConfig(OptimizerConfig):
    lr: float = setting(0.1, range=above(0))
    momentum: float = setting(0.9, range=FRACTION)
    nesterov: bool = False

    def problems(self) -> list[str]:
        found = super().problems() + _momentum(self.momentum)
        if self.nesterov and self.momentum == 0:
            found.append("optimizer.nesterov=true needs momentum: set optimizer.momentum > 0 (e.g. 0.9)")
        return found


@dataclass
class MuonConfig(OptimizerConfig):
    owner: Owner = Owner.deepspeed
    lr: float = setting(0.02, range=above(0))  # Muon's, for the hidden matrices
    momentum: float = setting(0.95, range=FRACTION)
    ns_method: NewtonSchulz = NewtonSchulz.gram
    adam_lr: float = setting(1e-3, range=above(0))  # the auxiliary AdamW's, for embeddings, the head, norms and biases
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], range=FRACTION)
    eps: float = setting(1e-8, range=above(0))

    def problems(self) -> list[str]:
        found = super().problems() + _momentum(self.momentum) + _betas(self.betas) + _eps(self.eps)
        if self.adam_lr <= 0:
            found.append(f"optimizer.adam_lr={self.adam_lr}: the auxiliary AdamW's learning rate must be > 0")
        return found
