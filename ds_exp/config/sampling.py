"""How generation samples: the options shared by generation during training (eval.temperature, eval.top_p,
eval.top_k) and `python -m ds_exp.chat` (--temperature, --top-p, --top-k), checked the same way."""

from __future__ import annotations

import math
from collections.abc import Callable


def sampling_problems(temperature: float, top_p: float, top_k: int, key: Callable[[str], str]) -> list[str]:
    """The sampling options of generation (eval.*, and python -m ds_exp.chat's --temperature ...): one line each.
    `key` names an option as the user gave it. top_p / top_k with greedy decoding would be silently ignored."""
    problems = [
        f"{key(name)}={value}: must be a finite number"
        for name, value in (("temperature", temperature), ("top_p", top_p))
        if not math.isfinite(value)
    ]
    if temperature < 0:
        problems.append(f"{key('temperature')}={temperature}: must be >= 0 (0 = greedy, e.g. 0.7 to sample)")
    if math.isfinite(top_p) and not 0 < top_p <= 1:
        problems.append(f"{key('top_p')}={top_p}: must be in (0, 1] (1 = off)")
    if top_k < 0:
        problems.append(f"{key('top_k')}={top_k}: must be >= 0 (0 = off)")
    if temperature == 0 and not problems and (top_p != 1 or top_k != 0):
        which = key("top_p") if top_p != 1 else key("top_k")
        problems.append(
            f"{which}={top_p if top_p != 1 else top_k} has no effect with {key('temperature')}=0 (greedy decoding): "
            f"set {key('temperature')} > 0 (e.g. 0.7) to sample, or leave {which} at its default"
        )
    return problems
