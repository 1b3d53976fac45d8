"""`python -m ds_exp --write-experiment PATH OVERRIDES...`: a command line saved as an experiment file (group choices,
values, sweeps; no credential), written new and only when it composes to the command line's own config."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf

from ds_exp.config.config_files import check_config_files
from ds_exp.config.override_checks import composition_problem
from ds_exp.config.paths import conf_dir
from ds_exp.config.place_checks import experiment_name_problem
from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import register_configs
from ds_exp.config.secret_shapes import is_reference, secret_spans
from ds_exp.config.secrets import ENV_PREFIX, holds_secret, is_env_set_value, is_secret_key, redact_text, secret_inside
from ds_exp.core.errors import ConfigError, first_line
from ds_exp.launch.run_config import flat_keys
from ds_exp.launch.storage import check_writable

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

FLAG = "--write-experiment"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_MULTIRUN_FLAGS = ("-m", "--multirun")
_CONFIG_DIR_FLAGS = ("-cd", "--config-dir")
# Hydra's bookkeeping, which differs between any two compositions: left out of the file-vs-command-line comparison
_VOLATILE_HYDRA = ("runtime", "overrides", "job", "searchpath", "sweeper.params")


@dataclass
class Plan:
    name: str
    path: Path  # DIR/experiment/NAME.yaml
    overrides: list[str]  # the command line's overrides that compose (no sweeps)
    config_dirs: list[str] = field(default_factory=list)  # --config-dir of the command line
    includes: list[str] = field(default_factory=list)  # `/experiment/PRESET`
    groups: list[tuple[str, str]] = field(default_factory=list)  # ("override /zero", "stage3")
    values: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    sweeps: dict[str, str] = field(default_factory=dict)  # key -> sweep expression
    left_out: list[str] = field(default_factory=list)  # what was not written, and why
    kept_args: list[str] = field(default_factory=list)  # the command line as shown in the header
    composed: DictConfig | None = None  # the command line's own config (the file must compose to it)

    @property
    def config_dir(self) -> Path:
        return self.path.parent.parent


def wants_experiment_file(argv: list[str]) -> bool:
    return any(arg == FLAG or arg.startswith(FLAG + "=") for arg in argv)


def write_experiment_main(argv: list[str]) -> int:
    """The whole command: returns the exit status; errors are raised as ConfigError (one message)."""
    path_arg, rest = _split_flag(argv)
    plan = plan_file(path_arg, rest)
    text = render(plan)
    check_same_config(plan, text)
    written = [render_body(plan), *plan.kept_args]  # the values and the command line (the header's prose is ours)
    if any(redact_text(part) != part or ENV_PREFIX in part for part in written):
        raise ConfigError(
            f"{FLAG}: a value of the command line is a credential (from the environment); nothing was written. "
            "Give credentials in the environment (WANDB_API_KEY, HF_TOKEN, ...) when you run the experiment"
        )
    write_new_file(plan.path, text)
    print(f"ds_exp: wrote {plan.path}")
    print(f"  run it:    {_run_command(plan)}" + ("   (a sweep: hydra.sweeper.params)" if plan.sweeps else ""))
    for note in plan.left_out:
        print(f"  left out:  {note}")
    return 0


def write_new_file(path: Path, text: str) -> None:
    """`text` as a new file at `path`, whole or not at all: never over a file, nothing left after a failure."""
    check_writable(path.parent, FLAG)
    made = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("x", encoding="utf-8") as fh:  # exclusive: never overwrites
            try:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            except BaseException:
                path.unlink(missing_ok=True)  # ours: made by this open
                raise
    except FileExistsError:
        raise ConfigError(_exists(path)) from None
    except OSError as err:
        for directory in made:  # innermost first: only those this call made, and only while empty
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise ConfigError(
            f"{FLAG} {path}: the file cannot be written ({err.strerror or first_line(err)}); nothing was written. "
            "Free some space, or give a path on a writable disk"
        ) from None


def _split_flag(argv: list[str]) -> tuple[str, list[str]]:
    for i, arg in enumerate(argv):
        if arg.startswith(FLAG + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        if arg == FLAG:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-") or "=" in argv[i + 1]:
                raise ConfigError(f"{FLAG} needs the file to write, e.g. {FLAG} my_exp.yaml zero=stage3 lora.dim=64")
            return argv[i + 1], argv[:i] + argv[i + 2 :]
    raise ConfigError(f"{FLAG} needs the file to write")


def destination(path_arg: str) -> tuple[str, Path]:
    """(NAME, DIR/experiment/NAME.yaml) for the PATH the user gave."""
    path = Path(path_arg).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        path = path.with_name(path.name + ".yaml")
    name = path.stem
    if not _NAME.match(name):
        raise ConfigError(
            f"{FLAG} {path_arg}: {name!r} cannot be an experiment name (it goes on the command line as "
            "experiment=NAME): use letters, digits, _, - and ."
        )
    if (conf_dir() / "experiment" / f"{name}.yaml").exists():
        raise ConfigError(
            f"{FLAG} {path_arg}: {name} is the name of a ds_exp preset (conf/experiment/{name}.yaml), which would be "
            "found before your file: choose another name"
        )
    if path.parent.name != "experiment":
        path = path.parent / "experiment" / path.name
    return name, path.absolute()


def _exists(path: Path) -> str:
    return f"{path} already exists; nothing was written. Choose another name, or edit that file"


def plan_file(path_arg: str, args: list[str]) -> Plan:
    name, path = destination(path_arg)
    if path.exists():
        raise ConfigError(_exists(path))
    plan = Plan(name=name, path=path, overrides=[])
    problems: list[str] = []
    parsed = []
    args_iter = iter(args)
    for arg in args_iter:
        if arg in _MULTIRUN_FLAGS:
            continue  # a file with sweeps is run with -m; one without is a single run
        if arg in _CONFIG_DIR_FLAGS or arg.startswith(tuple(f + "=" for f in _CONFIG_DIR_FLAGS)):
            value = arg.split("=", 1)[1] if "=" in arg else next(args_iter, "")
            plan.config_dirs.append(str(Path(value).expanduser().absolute()))
            continue
        if arg.startswith("-"):
            problems.append(
                f"{arg}: {FLAG} takes overrides (group=option, key=value) and --config-dir only; run with {arg} later"
            )
            continue
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except HydraException as err:
            problems.append(f"{arg}: not an override Hydra can read ({first_line(err)})")
            continue
        if override.is_delete():
            problems.append(f"{arg}: an experiment file cannot delete a key; leave it out, or set it to null")
            continue
        parsed.append((arg, override))
    if problems:
        raise ConfigError(problems)
    composable = [arg for arg, override in parsed if not override.is_sweep_override() and not _secret(override)]
    if not any(override.key_or_group == "experiment_name" for _, override in parsed):
        composable.append(f"experiment_name={name}")
    plan.overrides = composable
    check_config_files([*composable, *(f"--config-dir={d}" for d in plan.config_dirs)])
    cfg = plan.composed = compose_command_line(composable, plan.config_dirs)
    if (problem := experiment_name_problem(cfg.get("experiment_name"))) is not None:
        raise ConfigError(f"{FLAG}: {problem}; nothing was written")
    choices = cfg.hydra.runtime.choices
    for arg, override in parsed:
        key = override.key_or_group
        if _secret(override):
            plan.left_out.append(
                f"{key} ({_why_secret(override)}): give it in the environment or on the command line when you run "
                "the experiment"
            )
            continue
        plan.kept_args.append(arg)
        if override.is_sweep_override():
            plan.sweeps[arg.split("=", 1)[0]] = arg.split("=", 1)[1]
        elif key == "experiment":
            plan.includes.append(f"/experiment/{override.value()}")
        elif key in choices:
            package = f"@{override.package}" if override.package else ""
            prefix = "" if override.is_add() else "override "
            plan.groups.append((f"{prefix}/{key}{package}", str(override.value())))
        else:
            plan.values.update(_value_at(cfg, key))
    plan.values.setdefault("experiment_name", str(cfg.experiment_name))
    return plan


def _secret(override: Override) -> bool:
    """A literal secret (a `${oc.env:...}` only names one): by its key, as an env_set value, or by its shape."""
    if override.is_sweep_override():
        return False
    value = override.value()
    if isinstance(value, str) and is_reference(value):
        return False
    last = re.split(r"[./@]", override.key_or_group)[-1]
    by_name = is_secret_key(last) and holds_secret(value)
    return by_name or is_env_set_value(override.key_or_group, value) or secret_inside(value)


def _why_secret(override: Override) -> str:
    if is_secret_key(re.split(r"[./@]", override.key_or_group)[-1]):
        return "a credential"
    if is_env_set_value(override.key_or_group, override.value()):
        return "a variable of the job's environment, where credentials go"
    spans = secret_spans(str(override.value()))
    return f"its value holds {spans[0].what if spans else 'a credential'}"


def _value_at(cfg: DictConfig, key: str) -> dict[str, Any]:
    """{dotted key: value} for one overridden key: the value as composed, or the whole list it is an item of."""
    parts = key.split(".")
    parent: object = cfg
    for depth in range(1, len(parts)):
        parent = OmegaConf.select(cfg, ".".join(parts[:depth]), throw_on_missing=False)
        if isinstance(parent, ListConfig):  # YAML cannot set one item of a list: the list goes in whole
            return {".".join(parts[:depth]): [_without_defaults(item) for item in parent]}
    # from the parent, unresolved: `${oc.env:KEY}` is written as such, never as what it resolves to here
    value = _plain(parent)[parts[-1]]
    if isinstance(value, list) and isinstance(parent, DictConfig):  # a whole list given (data.sources=[...])
        return {key: [_without_defaults(item) for item in parent[parts[-1]]]}
    return {key: value}


def _without_defaults(item: object) -> Any:
    """A typed list item (a data source) with only what differs from its type's defaults."""
    kind = OmegaConf.get_type(item) if isinstance(item, DictConfig) else None
    written = _plain(item)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind) and isinstance(written, dict)):
        return written
    defaults = _plain(OmegaConf.structured(kind))
    return {key: value for key, value in written.items() if key not in defaults or value != defaults[key]}


def _plain(value: object) -> Any:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=False, enum_to_str=True)
    if isinstance(value, enum.Enum):
        return value.name
    return value


def compose_command_line(overrides: list[str], config_dirs: list[str]) -> DictConfig:
    """The config `python -m ds_exp [--config-dir D] OVERRIDES` composes (Hydra's compose API, in this process)."""
    register_resolvers()
    register_configs()
    search = [f"hydra.searchpath=[{','.join('file://' + d for d in config_dirs)}]"] if config_dirs else []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        try:
            return compose(config_name="config", overrides=[*overrides, *search], return_hydra_config=True)
        except HydraException as err:
            raise ConfigError(f"the command line does not compose: {redact_text(composition_problem(err))}") from None


def render_body(plan: Plan) -> str:
    """The file's settings, as YAML (render adds the header)."""
    defaults: list[str | dict[str, str]] = [*plan.includes, *({key: option} for key, option in plan.groups), "_self_"]
    tree: dict[str, Any] = {"defaults": defaults, "experiment_name": plan.values["experiment_name"]}
    for key, value in plan.values.items():
        _set(tree, key.split("."), value)
    if plan.sweeps:
        _set(tree, ["hydra", "sweeper", "params"], dict(plan.sweeps))
    return OmegaConf.to_yaml(OmegaConf.create(tree))


def render(plan: Plan) -> str:
    body = render_body(plan)
    command = " ".join(["python -m ds_exp", *map(_shell_word, plan.kept_args)])
    header = [
        "# @package _global_",
        f'# ds_exp experiment "{plan.name}", written by `python -m ds_exp {FLAG}` from:',
        f"#   {command}",
        f"# Run it:    {_run_command(plan)}",
        *_sweep_lines(plan),
        "# key=value after it changes a value for that run; `--cfg job` after it prints the composed config.",
    ]
    return "\n".join(header) + "\n" + body


def _shell_word(arg: str) -> str:
    """An argument as a person types it: bare when it can be, else in the quotes that need no escaping."""
    if shlex.quote(arg) == arg:
        return arg
    if "'" not in arg:
        return f"'{arg}'"
    if not any(c in arg for c in '"$`\\!'):
        return f'"{arg}"'
    return shlex.quote(arg)


def _run_command(plan: Plan) -> str:
    dirs = [*(d for d in plan.config_dirs if Path(d) != plan.config_dir), str(plan.config_dir)]
    config_dirs = " ".join(f"--config-dir {shlex.quote(d)}" for d in dirs)
    multirun = "-m " if plan.sweeps else ""
    return f"python -m ds_exp {multirun}{config_dirs} experiment={plan.name}"


def _sweep_lines(plan: Plan) -> list[str]:
    if plan.sweeps:
        return ["#   it sweeps hydra.sweeper.params below (one run per combination); more key=a,b,... add to them"]
    sweep = _run_command(plan).replace("python -m ds_exp ", "python -m ds_exp -m ", 1) + " optimizer.lr=1e-4,3e-4"
    return [f"# Sweep it:  {sweep}", "#   (any key=a,b,... on the command line, or list them in hydra.sweeper.params)"]


def _set(tree: dict[str, Any], parts: list[str], value: object) -> None:
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def check_same_config(plan: Plan, text: str) -> None:
    """Compose the file as `--config-dir DIR experiment=NAME` would, and compare with the command line's config."""
    expected = plan.composed if plan.composed is not None else compose_command_line(plan.overrides, plan.config_dirs)
    with tempfile.TemporaryDirectory(prefix="ds_exp_experiment_") as tmp:
        (Path(tmp) / "experiment").mkdir()
        (Path(tmp) / "experiment" / f"{plan.name}.yaml").write_text(text)
        dirs = [*(d for d in plan.config_dirs if Path(d) != plan.config_dir), tmp]
        got = compose_command_line([f"experiment={plan.name}"], dirs)
    a, b = _comparable(expected), _comparable(got)  # Hydra's bookkeeping left out
    keys = sorted(key for key in a.keys() | b.keys() if a.get(key, ...) != b.get(key, ...))
    differences = [f"{key}: {a.get(key)!r} on the command line, {b.get(key)!r} from the file" for key in keys]
    if differences:
        raise ConfigError(
            [f"{FLAG}: the file would not compose to the command line's config; nothing was written:", *differences]
        )


def _comparable(cfg: DictConfig) -> dict[str, Any]:
    tree = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    assert isinstance(tree, dict)  # a DictConfig's container
    hydra = tree.get("hydra", {})
    for dotted in _VOLATILE_HYDRA:
        *parents, last = dotted.split(".")
        node = hydra
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)
    return flat_keys(tree)
