"""ds_exp: Hydra-configured DeepSpeed supervised fine-tuning of Hugging Face causal language models.

The packages are the layers; each imports only from the layers below it (tests/unit/test_structure.py checks it):

    core                                errors, files written whole, every touch of a library's internals
    config -> data -> resume -> launch -> sweeps          light: no torch, no deepspeed
    runtime -> model -> checkpoint -> artifacts -> train -> tools          heavy

Entry points: `python -m ds_exp` (launch/cli.py), `python -m ds_exp.parity`, `ds_exp.report`, `ds_exp.universal`,
`ds_exp.export` and `ds_exp.chat` (tools/use/); in Python, `from ds_exp import train; summary = train([...])`
(the callable package ds_exp.train: train/api.py), whose errors are `ds_exp.DsExpError`.
Nothing heavy is imported here: `--help`, `--cfg job` and config validation never import torch or deepspeed.
"""

import importlib
from types import ModuleType

from ds_exp.core.errors import DsExpError
from ds_exp.core.lean_imports import keep_mlflow_out_of_deepspeed

__version__ = "0.1.0"
__all__ = ["DsExpError", "train"]

keep_mlflow_out_of_deepspeed()  # before anything imports deepspeed (core/lean_imports.py)


def __getattr__(name: str) -> ModuleType:
    """`ds_exp.train(...)` after a bare `import ds_exp`: the package, imported when first asked for (it is light)."""
    if name == "train":
        return importlib.import_module("ds_exp.train")
    raise AttributeError(f"module 'ds_exp' has no attribute {name!r}")
