"""`python -m ds_exp --help [GROUP ...]`: groups, options and knobs explained by conf/*.yaml's comments, read as text
(ms, not Hydra's ~1.5 s), so the help cannot fall out of step; a number's range comes from its field."""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ds_exp.config.paths import conf_dir
from ds_exp.config.ranges import RANGES  # the schema's (no torch): the command line imports it anyway

HELP_FLAGS = ("--help", "-h")
# Hydra's groups that ds_exp adds options to; Hydra's own default option is `basic`
HYDRA_DEFAULTS = {"hydra/launcher": "basic", "hydra/sweeper": "basic"}
HYDRA_GROUPS = {"hydra/launcher": "where the jobs of a sweep run", "hydra/sweeper": "which runs a sweep makes"}
HYDRA_BASIC = {
    "hydra/launcher": "Hydra's basic launcher: the jobs of a sweep one after another, in this process.",
    "hydra/sweeper": "Hydra's basic sweeper: every combination of the key=a,b,... values (a grid).",
}
_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<dash>- )?(?P<key>[A-Za-z_][\w.-]*):(?:\s+(?P<rest>.*))?$")
_DEFAULT_LINE = re.compile(r"^\s+- (?:override )?/?(?P<group>[\w/]+):\s*(?P<option>[\w.-]+)(?:\s+#\s?(?P<doc>.*))?$")

RECIPES = """\
  python -m ds_exp                                       the tiny model on synthetic data, on this CPU (about 9 s)
  python -m ds_exp model=local model.name_or_path=DIR data=local data.sources.0.path=FILE.jsonl
                                                         your checkpoint on your data (JSON/JSONL/CSV/Parquet rows)
  python -m ds_exp zero=stage3 precision=bf16 lora.dim=64 ZeRO-3, bf16, LoRA adapters of rank 64
  python -m ds_exp dry_run=true ...                      check, plan memory, write ds_config.json; no weights
  python -m ds_exp hydra.run.dir=RUN_DIR resume=auto     continue a run from its newest complete checkpoint
  python -m ds_exp -m zero=stage2,stage3 optimizer.lr=1e-4,3e-4     a sweep (4 runs) and its report
  python -m ds_exp -m hydra/sweeper=optuna 'optimizer.lr=tag(log,interval(1e-5,1e-3))'   an optuna study
  python -m ds_exp -m experiment=autotune                which configuration fits and is fastest
  torchrun --nproc_per_node 2 -m ds_exp zero=stage2      two ranks (or hydra/launcher=slurm for SLURM jobs)
  python -m ds_exp --write-experiment exps/my_exp.yaml zero=stage3 lora.dim=64    this command line as a file;
  python -m ds_exp --config-dir exps experiment=my_exp                            then run it"""

USAGE = """\
  python -m ds_exp [GROUP=OPTION ...] [KEY=VALUE ...]    one run, in outputs/<experiment_name>/<date_time>/
  python -m ds_exp -m KEY=A,B [KEY=C,D ...]              a sweep: one run per combination
  python -m ds_exp --config-dir DIR experiment=NAME      your experiment file DIR/experiment/NAME.yaml
  python -m ds_exp --write-experiment FILE OVERRIDES     write that file from a command line
  python -m ds_exp --help GROUP [GROUP ...]              every option of those groups and all of their knobs
  python -m ds_exp OVERRIDES --cfg job                   the composed config (nothing runs); --hydra-help: Hydra's"""


@dataclass
class Knob:
    key: str  # dotted, inside the group's package (`micro_batch_size`, `sources.0.path`)
    value: str  # as written in the file ("" for a block)
    doc: str  # the inline comment, else the comment block above it
    above: str = ""  # the comment block above it (shown by --help GROUP)


@dataclass
class Option:
    group: str
    name: str
    header: list[str] = field(default_factory=list)  # the file's leading comment lines
    package: str | None = None  # `# @package X`
    knobs: list[Knob] = field(default_factory=list)
    sets: list[str] = field(default_factory=list)  # an experiment's defaults: `model=opt-1.3b`, ...

    @property
    def summary(self) -> str:
        """The first sentence of the header."""
        text = " ".join(line.strip() for line in self.header if not line.startswith("  "))
        return re.split(r"(?<=\.)\s", text, maxsplit=1)[0] if text else ""

    @property
    def prefix(self) -> str:
        package = self.package if self.package is not None else self.group.replace("/", ".")
        return "" if package in ("_global_", "") else package + "."


def parse_option(path: Path, group: str) -> Option:
    """One conf/ file as an Option (its header, package and knobs), from its text."""
    option = Option(group=group, name=path.stem)
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing blocks
    list_index: dict[tuple[int, str], int] = {}  # (indent, parent path) -> the current list item
    pending: list[str] = []  # comment lines since the last key
    last: Knob | None = None
    last_indent = -1
    in_header, in_defaults = True, False
    for raw in path.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            text = stripped[1:]
            text = text[1:] if text.startswith(" ") else text
            if stripped.startswith("# @package"):
                option.package = stripped.split(None, 2)[2].strip()
            elif in_header:
                option.header.append(text)
            elif last is not None and not pending and len(raw) - len(raw.lstrip()) > last_indent and last.doc:
                last.doc += " " + text.strip()  # an indented comment line continues the one above
            else:
                pending.append(text.strip())
            continue
        if not stripped:
            pending = []
            continue
        choice = _DEFAULT_LINE.match(raw) if in_defaults else None
        if choice:
            option.sets.append(f"{choice['group']}={choice['option']}")
            continue
        match = _KEY_LINE.match(raw)
        if not match:
            continue  # the continuation of a flow value, an entry of a defaults list
        in_header = False
        indent = len(match["indent"]) + (2 if match["dash"] else 0)
        key = match["key"]
        if indent == 0:
            in_defaults = key == "defaults"
        if in_defaults:
            continue
        rest = match["rest"] or ""
        value, _, doc = rest.partition(" #") if not rest.startswith("#") else ("", "", rest[1:])
        while stack and stack[-1][0] >= indent - (1 if match["dash"] else 0):  # a new item closes the one before
            stack.pop()
        parents = [k for _, k in stack]
        if match["dash"]:
            slot = (indent, ".".join(parents))
            list_index[slot] = list_index.get(slot, -1) + 1
            stack.append((indent - 1, str(list_index[slot])))
            parents = [k for _, k in stack]
        dotted = ".".join([*parents, key])
        above = " ".join(pending)
        last = Knob(dotted, value.strip(), doc.strip() or above, above if doc.strip() else "")
        last_indent = indent
        option.knobs.append(last)
        pending = []
        if not value.strip():
            stack.append((indent, key))
    return option


@dataclass
class Catalog:
    groups: dict[str, list[Option]]  # group -> its options, the default first
    defaults: dict[str, str]  # group -> default option
    group_docs: dict[str, str]  # group -> the comment of its line in config.yaml's defaults
    root: Option  # config.yaml's own knobs


def load_catalog(root: Path | None = None) -> Catalog:
    root = root or conf_dir()
    defaults: dict[str, str] = {}
    docs: dict[str, str] = {}
    for line in (root / "config.yaml").read_text(encoding="utf-8").splitlines():
        if line.startswith("hydra:"):
            break
        match = _DEFAULT_LINE.match(line)
        if match:
            defaults[match["group"]] = match["option"]
            docs[match["group"]] = (match["doc"] or "").strip()
    defaults.update(HYDRA_DEFAULTS)
    docs.update(HYDRA_GROUPS)
    order = [g for g in defaults if g != "experiment"] + ["experiment"]
    folders = sorted({p.parent.relative_to(root).as_posix() for p in root.rglob("*.yaml") if p.parent != root})
    groups: dict[str, list[Option]] = {}
    for group in [*order, *(f for f in folders if f not in order)]:
        files = sorted((root / group).glob("*.yaml"))
        if not files or (group.startswith("hydra/") and group not in HYDRA_GROUPS):  # ds_exp's own logging: no choice
            continue
        options = [parse_option(p, group) for p in files]
        options.sort(key=lambda o: o.name != defaults.get(group))  # the default first, the rest by name
        groups[group] = options
    return Catalog(groups, defaults, docs, parse_option(root / "config.yaml", ""))


_KEY_WIDTH = 40


def _width() -> int:
    return max(80, min(shutil.get_terminal_size((120, 24)).columns, 140))


def knob_line(key: str, value: str, doc: str, indent: str = "  ") -> list[str]:
    left = f"{indent}{key}={value}" if value else f"{indent}{key}"
    if key in RANGES and doc:
        doc += f" ({RANGES[key].said().removeprefix('must be ')})"
    if not doc:
        return [left]
    room = _width() - _KEY_WIDTH - 1
    wrapped = textwrap.wrap(doc, max(room, 30)) or [""]
    pad = " " * _KEY_WIDTH
    if len(left) < _KEY_WIDTH:
        return [left.ljust(_KEY_WIDTH) + wrapped[0], *(pad + w for w in wrapped[1:])]
    return [left, *(pad + w for w in wrapped)]


def _documented(option: Option) -> list[Knob]:
    """The knobs worth a line: those with a comment (a block's children without one are its details)."""
    return [k for k in option.knobs if k.doc]


def _options_line(catalog: Catalog, group: str) -> str:
    default = catalog.defaults.get(group)
    names = [o.name for o in catalog.groups[group]]
    if group in HYDRA_DEFAULTS:
        names = ["basic", *names]
    return ", ".join(f"{n}*" if n == default else n for n in names)


def overview(catalog: Catalog) -> str:
    out = [
        "ds_exp: DeepSpeed supervised fine-tuning of Hugging Face causal LMs, configured with Hydra.",
        "",
        "Usage",
        USAGE,
        "",
        "Recipes",
        RECIPES,
        "",
        "Groups: pick an option with GROUP=OPTION (* = the default); `--help GROUP` shows each option and its knobs",
    ]
    width = max(len(g) for g in catalog.groups) + 4
    for group in catalog.groups:
        doc = catalog.group_docs.get(group, "")
        line = _options_line(catalog, group) + (f" -- {doc}" if doc else "")
        wrapped = textwrap.wrap(line, _width() - width - 2, break_on_hyphens=False)
        out += [f"  {(group if i == 0 else '').ljust(width)}{w}" for i, w in enumerate(wrapped)]
    out += ["", "Knobs: change one with KEY=VALUE (shown with the default options' values)"]
    for knob in _documented(catalog.root):
        if not knob.key.startswith(("deepspeed.config.", "hydra.")):  # built from the groups; Hydra's settings
            out += knob_line(knob.key, knob.value, knob.doc)
    for group, options in catalog.groups.items():
        default = options[0] if options[0].name == catalog.defaults.get(group) else None
        if default is None or group == "experiment":
            continue
        knobs = [k for k in _documented(default) if k.key != "name"]
        out += textwrap.wrap(f"{group}={default.name}: {default.summary}", _width(), subsequent_indent="    ")
        for knob in knobs:
            out += knob_line(default.prefix + knob.key, knob.value, knob.doc, "    ")
        more = sorted({o.name for o in options[1:] if {k.key for k in o.knobs} - {k.key for k in default.knobs}})
        if more:
            note = f"({group}={'|'.join(more)} add knobs: python -m ds_exp --help {group})"
            out += textwrap.wrap(note, _width(), initial_indent="    ", subsequent_indent="     ")
    out += [
        "",
        "Every value is checked before anything heavy runs; `dry_run=true` also plans memory and writes the DeepSpeed",
        "config. Hydra's own flags (--cfg, --resolve, --info, --config-dir, -m): python -m ds_exp --hydra-help",
    ]
    return "\n".join(out) + "\n"


def group_help(catalog: Catalog, group: str) -> str:
    doc = catalog.group_docs.get(group)
    out = [f"{group}: {doc}" if doc else group, f"  choose with {group}=OPTION; * = the default", ""]
    if group in HYDRA_BASIC:
        out += [f"{group}=basic *", f"  {HYDRA_BASIC[group]}", ""]
    for option in catalog.groups[group]:
        star = " *" if option.name == catalog.defaults.get(group) else ""
        out.append(f"{group}={option.name}{star}")
        out += [f"  {line}" for line in option.header]
        if option.sets:
            out.append(f"  sets {' '.join(option.sets)}")
        if option.knobs:
            out.append("  knobs:")
        for knob in option.knobs:
            if knob.above:
                out += [f"    # {line}" for line in textwrap.wrap(knob.above, _width() - 6)]
            out += knob_line(option.prefix + knob.key, knob.value, knob.doc, "    ")
        out.append("")
    return "\n".join(out)


def help_text(names: list[str], catalog: Catalog | None = None) -> str:
    catalog = catalog or load_catalog()
    if not names:
        return overview(catalog)
    # `zero=stage3 --help` shows the zero group; other key=value overrides of a command line are passed over
    names = [n.split("=")[0] for n in names if "=" not in n or n.split("=")[0] in catalog.groups]
    unknown = [n for n in names if n not in catalog.groups]
    if unknown:
        raise KeyError(
            f"--help {' '.join(unknown)}: not a group; --help takes group names ({', '.join(catalog.groups)}). "
            "The config a command line composes: python -m ds_exp OVERRIDES --cfg job"
        )
    return "\n".join(group_help(catalog, n) for n in dict.fromkeys(names)) if names else overview(catalog)


def wants_help(argv: list[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def main(argv: list[str]) -> None:
    """Print the help for the command line's group names (the other arguments are left out) and exit."""
    names = [a for a in argv if a not in HELP_FLAGS and not a.startswith("-")]
    try:
        text = help_text(names)
    except KeyError as err:
        print(f"ds_exp: error: {err.args[0]}", file=sys.stderr)
        sys.exit(2)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `--help | head`
        pass
    sys.exit(0)
