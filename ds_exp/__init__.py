"""ds_exp: Hydra-configured DeepSpeed supervised fine-tuning of Hugging Face causal language models.

The packages are the layers; each imports only from the layers below it (tests/unit/test_structure.py checks it):

    core                                errors, files written whole, every touch of a library's internals
    config -> data -> resume -> launch -> sweeps          light: no torch, no deepspeed
    runtime -> model -> checkpoint -> artifacts -> train -> tools          heavy

Entry points: `python -m ds_exp` (launch/cli.py), `python -m ds_exp.parity`, `ds_exp.report`, `ds_exp.universal`,
`ds_exp.export` and `ds_exp.chat` (exports/); in Python, `from ds_exp import train; summary = train([...])`
(the callable package ds_exp.train: train/api.py), whose errors are `ds_exp.DsExpError`.
Nothing heavy is imported here, and importing ds_exp changes nothing of the process (no import hook, no patch of a
library): `--help`, `--cfg job` and config validation never import torch or deepspeed."""

import importlib
import sys
from types import ModuleType

# pyproject's requires-python: pip checks it, a run from a checkout does not (ruff: the block is for older Pythons)
if sys.version_info < (3, 11):  # noqa: UP036
    raise SystemExit(
        f"ds_exp needs Python 3.11 or newer and this is {sys.version.split()[0]}: see README.md, Set-up, for "
        "installing a 3.11 beside the system's Python"
    )

from ds_exp.core.errors import DsExpError

__version__ = "0.1.0"
__all__ = ["DsExpError", "train"]


def __getattr__(name: str) -> ModuleType:
    """`ds_exp.train(...)` after a bare `import ds_exp`: the package, imported when first asked for (it is light)."""
    if name == "train":
        return importlib.import_module("ds_exp.train")
    raise AttributeError(f"module 'ds_exp' has no attribute {name!r}")
