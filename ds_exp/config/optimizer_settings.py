"""The optimizers' typed settings, one dataclass per kind, each number's range beside its field; the option's YAML names
its class, so Hydra refuses a wrong type or another optimizer's key while it composes. Light."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omegaconf import MISSING

from ds_exp.config.fields import Range, above, at_least, setting


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
BETAS = Range(0, 1, high_open=True, fix=", e.g. [0.9,0.95]")  # each of the pair
MOMENTUM = Range(0, 1, high_open=True, fix=" (e.g. 0.9)")


@dataclass
class OptimizerConfig:
    """What every optimizer's settings have; each kind's class adds its own."""

    owner: Owner = Owner.ds_exp
    name: str = MISSING  # the option picked in conf/optimizer (its settings class must match)
    lr: float = setting(1e-3, range=above(0, " (the learning rate; DeepSpeed-Chat uses 1e-3 for SFT)"))
    weight_decay: float = setting(0.0, range=at_least(0))  # decoupled (AdamW-style) unless the optimizer says otherwise
    no_decay: list[str] = field(default_factory=lambda: list(NO_DECAY))

    def problems(self) -> list[str]:
        """What the ranges cannot say: a pair of betas, SGD's nesterov without momentum."""
        betas = getattr(self, "betas", [0.0, 0.0])
        if len(betas) != 2:
            return [f"optimizer.betas={list(betas)}: give two numbers in [0, 1), e.g. [0.9,0.95]"]
        return []


@dataclass
class AdamConfig(OptimizerConfig):
    impl: OptimizerImpl = OptimizerImpl.auto
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], range=BETAS)
    eps: float = setting(1e-8, range=above(0))


@dataclass
class Adam8bitConfig(OptimizerConfig):
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], range=BETAS)
    eps: float = setting(1e-8, range=above(0))


@dataclass
class LionConfig(OptimizerConfig):
    impl: OptimizerImpl = OptimizerImpl.auto
    lr: float = setting(3e-4)
    betas: list[float] = setting(factory=lambda: [0.9, 0.99], range=BETAS)


@dataclass
class AdafactorConfig(OptimizerConfig):
    lr: float = setting(1e-2)  # torch's Adafactor: the largest relative step (its step is lr x the parameter's RMS)
    beta2_decay: float = setting(-0.8, range=Range(None, 0, fix=" (torch's Adafactor default: -0.8)"))
    eps: float | None = setting(None, range=above(0))  # added to the second moment; null = the dtype's smallest step
    eps_scale: float = setting(1e-3, range=at_least(0))  # the smallest parameter RMS a step is scaled by
    d: float = setting(1.0, range=at_least(1, " (the clipping threshold of the update's RMS; torch's default 1.0)"))


@dataclass
class SGDConfig(OptimizerConfig):
    lr: float = setting(0.1)
    momentum: float = setting(0.9, range=MOMENTUM)
    nesterov: bool = False

    def problems(self) -> list[str]:
        if self.nesterov and self.momentum == 0:
            return ["optimizer.nesterov=true needs momentum: set optimizer.momentum > 0 (e.g. 0.9)"]
        return []


@dataclass
class MuonConfig(OptimizerConfig):
    owner: Owner = Owner.deepspeed
    lr: float = setting(0.02)  # Muon's, for the hidden matrices
    momentum: float = setting(0.95, range=MOMENTUM)
    ns_method: NewtonSchulz = NewtonSchulz.gram
    adam_lr: float = setting(1e-3, range=above(0, " (the auxiliary AdamW's learning rate)"))  # embeddings, head, norms
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], range=BETAS)
    eps: float = setting(1e-8, range=above(0))
