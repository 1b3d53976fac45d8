"""LoRA through PEFT. `lora.module_name` (a scope), `lora.target_modules` (suffixes, a regex, or `all-linear`) and
`lora.modules_to_save` resolve here, once, to full module names: PEFT, the dry run and messages name the same layers."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from ds_exp.config import schema
from ds_exp.config.lora_checks import ALL_LINEAR, scope_of
from ds_exp.core.errors import ConfigError

LINEAR_TYPES = (torch.nn.Linear, Conv1D)  # Conv1D: GPT-2's linear layers (weights stored transposed)


def linear_layers(model: torch.nn.Module) -> list[str]:
    """Full names of the model's linear layers (what LoRA can adapt), in model order."""
    return [name for name, module in model.named_modules() if isinstance(module, LINEAR_TYPES)]


def _layer_names(model: torch.nn.Module, names: list[str]) -> str:
    """The distinct last parts of `names`, in order, each with one full example: what a message lists."""
    first: dict[str, str] = {}
    for name in names:
        first.setdefault(name.rsplit(".", 1)[-1], name)
    shown = [f"{leaf} ({full})" if leaf != full else leaf for leaf, full in list(first.items())[:12]]
    return ", ".join(shown) + (" ..." if len(first) > 12 else "")


def _matches(name: str, target: str) -> bool:
    """PEFT's list entry: the whole name, or its end after a dot."""
    return name == target or name.endswith(f".{target}")


def _output_layer(model: torch.nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    output = get() if get is not None else None
    return next((name for name, module in model.named_modules() if module is output), None) if output else None


def lora_target_names(model: torch.nn.Module, lora_cfg: schema.LoraConfig, model_scope: str | None) -> list[str]:
    """Full names of the linear layers that get adapters; one line per setting matching none."""
    linears = linear_layers(model)
    scope = scope_of(lora_cfg, model_scope)
    in_scope = [name for name in linears if scope is None or scope in name]
    targets = lora_cfg.target_modules
    if not in_scope:
        scopes = sorted({name.rsplit(".", 1)[0] + "." for name in linears if "." in name})
        example = ", ".join(scopes[:8]) + (" ..." if len(scopes) > 8 else "")
        hint = (
            ""
            if lora_cfg.module_name is not None
            else " (model.lora_scope, this model's own scope)"
            if model_scope
            else " (the default scope when lora.target_modules is null)"
        )
        raise ConfigError(
            f"lora.module_name={scope}{hint} matches no Linear layer of this model; Linear layers live under: "
            f"{example} (e.g. lora.module_name=layers., or name them with lora.target_modules=[...])"
        )
    where = f" inside lora.module_name={scope}" if scope is not None else ""
    if targets is None:
        return in_scope
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        output = _output_layer(model)
        chosen = [name for name in in_scope if name != output]
        if not chosen:
            raise ConfigError(f"lora.target_modules={ALL_LINEAR}: no Linear layer{where} but the output layer")
        return chosen
    if isinstance(targets, str):
        chosen = [name for name in in_scope if re.fullmatch(targets, name)]
        if not chosen:
            # one name given as a string is PEFT's regex, which must match the whole name: the classic slip
            named = any(_matches(name, targets) for name in in_scope)
            hint = f"; for layers named {targets}, give a list: lora.target_modules=[{targets}]" if named else ""
            raise ConfigError(
                f"lora.target_modules={targets!r} (a regular expression, matched against whole names) matches no "
                f"Linear layer{where}{hint}; this model's Linear layers: {_layer_names(model, in_scope)}"
            )
        return chosen
    problems = []
    modules = dict(model.named_modules())
    for target in targets:
        if any(_matches(name, target) for name in in_scope):
            continue
        others = [n for n in modules if _matches(n, target) and (scope is None or scope in n)]
        if others:
            kind = type(modules[others[0]]).__name__
            problems.append(
                f"lora.target_modules: {target} is a {kind}, not a Linear layer (LoRA adapts Linear layers); to "
                f"train it whole, list it in lora.modules_to_save"
            )
        else:
            problems.append(
                f"lora.target_modules: {target} matches no Linear layer{where}; this model's Linear layers: "
                f"{_layer_names(model, in_scope)}"
            )
    if problems:
        raise ConfigError(problems)
    return [name for name in in_scope if any(_matches(name, t) for t in targets)]


def modules_to_save_names(model: torch.nn.Module, lora_cfg: schema.LoraConfig, targets: list[str]) -> list[str]:
    """Full names of the modules trained whole; a line per entry matching nothing or holding adapters."""
    wanted = list(lora_cfg.modules_to_save or [])
    if not wanted:
        return []
    modules = [name for name, _ in model.named_modules() if name]
    chosen: list[str] = []
    problems = []
    for entry in wanted:
        found = [name for name in modules if name.endswith(entry)]
        # a module inside another one found is saved with it (PEFT wraps the outer one)
        found = [n for n in found if not any(n.startswith(f"{o}.") for o in found)]
        if not found:
            leaves = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in modules if not n.rsplit(".", 1)[-1].isdigit()))
            more = " ..." if len(leaves) > 20 else ""
            problems.append(
                f"lora.modules_to_save: {entry} matches no module of this model (an entry matches the end of a "
                f"module's full name); its modules are named: {', '.join(leaves[:20])}{more}"
            )
            continue
        adapted = [n for n in found if n in targets or any(t.startswith(f"{n}.") for t in targets)]
        if adapted:
            problems.append(
                f"lora.modules_to_save: {entry} matches {adapted[0]}, which holds LoRA adapters (lora.target_modules / "
                "lora.module_name): a module is either adapted or trained whole; narrow one of the two"
            )
            continue
        chosen += [n for n in found if n not in chosen]
    if problems:
        raise ConfigError(problems)
    return chosen


def tied_elsewhere(model: torch.nn.Module, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(saved module, module outside the list) pairs sharing weights: PEFT trains the saved one as its own copy."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    pairs = []
    for name in names:
        for param in model.get_submodule(name).parameters():
            outside = [o for o in owners.get(id(param), []) if not any(o == n or o.startswith(f"{n}.") for n in names)]
            if outside:
                pairs.append((name, outside[0]))
                break
    return pairs


@dataclass(frozen=True)
class LoraSpec:
    """What PEFT needs to wrap (and later rebuild for export) the same adapters."""

    dim: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    only_optimize: bool
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False
    use_rslora: bool = False
    quantize: str | None = None  # 4bit | 8bit: the base was loaded quantized (QLoRA)

    @property
    def scaling(self) -> float:
        """The adapters' factor: alpha / dim, or alpha / sqrt(dim) with rsLoRA."""
        return self.alpha / (self.dim**0.5 if self.use_rslora else self.dim)

    def describe(self) -> dict[str, Any]:
        """For ds_exp_export.json and the log: what the adapters are."""
        return {
            "rank": self.dim,
            "alpha": self.alpha,
            "scaling": self.scaling,
            "use_dora": self.use_dora,
            "use_rslora": self.use_rslora,
            "targets": len(self.targets),
            "modules_to_save": list(self.modules_to_save),
            "quantize": self.quantize,
        }


def adapted_by_part(model: torch.nn.Module, targets: tuple[str, ...]) -> dict[str, int]:
    """Adapted layers per part of a model of several (the first two components of the names); {} for one part."""
    output = _output_layer(model)
    parts = dict.fromkeys(".".join(name.split(".")[:2]) for name in linear_layers(model) if name != output)
    if len(parts) < 2:
        return {}
    counts = dict.fromkeys(parts, 0)
    for name in targets:
        part = ".".join(name.split(".")[:2])
        if part in counts:
            counts[part] += 1
    return counts


def lora_spec(lora_cfg: schema.LoraConfig, model: torch.nn.Module, model_scope: str | None = None) -> LoraSpec:
    """The adapters lora.* asks for on `model` (scope `model_scope`); a ConfigError names what matches nothing."""
    targets = lora_target_names(model, lora_cfg, model_scope)
    saved = modules_to_save_names(model, lora_cfg, targets)
    return LoraSpec(
        dim=int(lora_cfg.dim),
        alpha=float(lora_cfg.alpha if lora_cfg.alpha is not None else lora_cfg.dim),
        dropout=float(lora_cfg.dropout),
        targets=tuple(targets),
        only_optimize=bool(lora_cfg.only_optimize),
        modules_to_save=tuple(saved),
        use_dora=bool(lora_cfg.use_dora),
        use_rslora=bool(lora_cfg.use_rslora),
        quantize=lora_cfg.quantize,
    )


def count_with_lora(model: torch.nn.Module, spec: LoraSpec) -> tuple[int, int]:
    """(parameters, trainable) of `model` once wrap_lora wraps it, counted without wrapping."""
    base = {id(p): p.numel() for p in model.parameters()}
    adapters = 0
    for name in spec.targets:
        fan_in, fan_out = in_out_features(model.get_submodule(name))
        adapters += spec.dim * (fan_in + fan_out) + (fan_out if spec.use_dora else 0)
    copies = sum(p.numel() for name in spec.modules_to_save for p in model.get_submodule(name).parameters())
    originals = {id(p): p.numel() for name in spec.modules_to_save for p in model.get_submodule(name).parameters()}
    pairs = tied_elsewhere(model, spec.modules_to_save)
    tied = {id(p) for name, _ in pairs for p in model.get_submodule(name).parameters()}
    total = sum(base.values()) + adapters + copies
    if spec.only_optimize:
        return total, adapters + copies
    frozen = sum(n for key, n in originals.items() if key not in tied)
    return total, total - frozen


def in_out_features(module: torch.nn.Module) -> tuple[int, int]:
    if isinstance(module, Conv1D):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return int(module.in_features), int(module.out_features)  # type: ignore[arg-type]  # nn.Linear's ints


def wrap_lora(model: PreTrainedModel, spec: LoraSpec) -> PeftModel:
    """PEFT LoRA on exactly the listed layers (B = 0 at start); the modules to save trained as copies."""
    modules = dict(model.named_modules())
    peft_config = LoraConfig(
        r=spec.dim,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # PEFT hints int; the scaling takes any number
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        modules_to_save=list(spec.modules_to_save) or None,
        use_dora=spec.use_dora,
        use_rslora=spec.use_rslora,
        # GPT-2's Conv1D stores its weight transposed (PEFT would warn and set it per layer)
        fan_in_fan_out=any(isinstance(modules[name], Conv1D) for name in spec.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # a saved module tied to another (lm_head with tie_word_embeddings) is trained as its own copy: meant here
        warnings.filterwarnings("ignore", message=".*tied layer is part of the adapter.*")
        wrapped = get_peft_model(model, peft_config)
    assert isinstance(wrapped, PeftModel)  # a PeftMixedModel only with mixed=True
    if not spec.only_optimize:
        # the base trains too, but not the originals of the saved modules, unused while the adapter is active (one
        # tied to a module outside the list, such as lm_head to the embedding, trains as that module's weight)
        for name, param in wrapped.named_parameters(remove_duplicate=False):
            if "lora_" not in name and ".original_module." not in name:
                param.requires_grad_(True)
    return wrapped


def merge_lora(model: PeftModel) -> PreTrainedModel:
    """The plain model, adapters merged, saved modules' copies in place (a tied lm_head stays untied)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no longer tied after merging.*")
        merged = model.merge_and_unload()
    assert isinstance(merged, PreTrainedModel)  # the base model the adapters were merged into
    return merged


def quantized_loading(quantize: str, compute_dtype: torch.dtype) -> dict[str, Any]:
    """from_pretrained's arguments for a bitsandbytes 4-bit (NF4) or 8-bit base on this rank's GPU; UNTESTED."""
    if quantize == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config, "device_map": {"": torch.cuda.current_device()}, "dtype": compute_dtype}


def prepare_quantized(model: PreTrainedModel) -> PreTrainedModel:
    """PEFT's preparation of a k-bit base (norms in fp32, frozen); build_model sets up gradient checkpointing later."""
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
