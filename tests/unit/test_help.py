"""`python -m ds_exp --help` explains the groups and every knob with the comments of conf/*.yaml, and the
common recipes; `--help GROUP` shows each option of a group in full. (Its speed: bench/help_time.py.)"""

from __future__ import annotations

import pytest

from ds_exp.config.paths import conf_dir
from ds_exp.launch.help import help_text, load_catalog, parse_option
from tests.conftest import run_cli


def test_the_parser_reads_every_comment_form(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "# @package hydra.launcher\n"
        "# What this option is. More about it.\n"
        "#   python -m ds_exp x=y\n"
        "defaults:\n"
        "  - override /model: tiny  # not a knob\n"
        "name: x\n"
        "impl: auto  # auto = the first choice,\n"
        "            # continued on the next line\n"
        "# the block above a key\n"
        "size: 3\n"
        "sources:  # a list\n"
        "  - path: ???  # first file\n"
        "    layout: auto  # its rows\n"
        "  - path: b.json  # second file\n"
        "nested:\n"
        "  inner: 1  # deep\n"
    )
    option = parse_option(path, "hydra/launcher")
    assert option.package == "hydra.launcher" and option.prefix == "hydra.launcher."
    assert option.header == ["What this option is. More about it.", "  python -m ds_exp x=y"]
    assert option.summary == "What this option is."
    assert option.sets == ["model=tiny"]
    knobs = {k.key: (k.value, k.doc) for k in option.knobs}
    assert knobs["impl"] == ("auto", "auto = the first choice, continued on the next line")
    assert knobs["size"] == ("3", "the block above a key")
    assert knobs["sources.0.path"] == ("???", "first file")
    assert knobs["sources.0.layout"] == ("auto", "its rows")
    assert knobs["sources.1.path"] == ("b.json", "second file")
    assert knobs["nested.inner"] == ("1", "deep")
    assert "override /model" not in knobs and "defaults" not in knobs


def test_help_explains_every_group_and_every_knob_of_the_defaults():
    catalog = load_catalog()
    text = help_text([], catalog)
    assert "Recipes" in text and "--write-experiment" in text and "experiment=NAME" in text
    for group, options in catalog.groups.items():
        assert f"  {group} " in text, group
        for option in options:
            assert option.name in text, (group, option.name)
    for group in ("model", "data", "zero", "precision", "offload", "lora", "optimizer", "scheduler", "train"):
        default = next(o for o in catalog.groups[group] if o.name == catalog.defaults[group])
        for knob in default.knobs:
            if knob.doc and knob.key != "name":  # each knob with its value and the first words of its comment
                assert f"{default.prefix}{knob.key}={knob.value}" in text or f"{default.prefix}{knob.key}" in text
                assert " ".join(knob.doc.split()[:3]) in " ".join(text.split()), knob.key
    assert "experiment_name=default" in text and "names outputs/<name>/" in text
    # a number's range after its comment, read from its field as validation reads it
    # (the text wraps at the terminal's width: compare it unwrapped)
    assert "train.micro_batch_size=16 samples per device per forward pass (>= 1)" in " ".join(text.split())
    assert "(from 1 to 65535)" in " ".join(help_text(["dist"], catalog).split())


def test_help_of_a_group_shows_each_option_in_full():
    text = help_text(["zero", "hydra/launcher=slurm"])
    for line in (conf_dir() / "zero" / "stage3.yaml").read_text().splitlines():
        if "  # " in line:  # every knob of the option, with its comment
            key, _, comment = line.partition(":")
            assert f"zero.{key.strip()}=" in text and " ".join(comment.split("#", 1)[1].split()[:4]) in " ".join(
                text.split()
            )
    assert "hydra.launcher.partition=null" in text and "SLURM partition" in text
    assert "hydra/launcher=basic *" in text
    with pytest.raises(KeyError, match="not a group"):
        help_text(["nosuchgroup"])


def test_help_from_the_command_line(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "train.micro_batch_size=16" in result.stdout and "samples per device per forward pass" in result.stdout
    assert "Powered by Hydra" not in result.stdout  # not Hydra's stock dump
    one = run_cli("zero=stage3", "lora.dim=8", "--help", cwd=tmp_path)  # --help after a command line: its groups
    assert one.returncode == 0 and one.stdout.startswith("zero: ") and "zero=stage3" in one.stdout
    bad = run_cli("--help", "nosuchgroup", cwd=tmp_path)
    assert bad.returncode == 2 and "ds_exp: error: --help nosuchgroup: not a group" in bad.stderr
