"""Lion (Chen et al. 2023) in torch, for a CPU without optimizer offload (DeepSpeed's Lions need a compiled op):
p <- p (1 - lr wd) - lr sign(beta1 m + (1 - beta1) g), then m <- beta2 m + (1 - beta2) g, as theirs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                momentum = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = momentum.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
