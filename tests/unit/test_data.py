"""The SFT data pipeline: sources, splits, blending, cache, labels, errors (ds_exp.data)."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ds_exp.config.schema import Config, DataConfig, DataSource, ModelConfig, plain_tree, schema_for, to_config
from ds_exp.core.errors import ConfigError, DataError
from ds_exp.data.checks import data_config_problems
from ds_exp.data.pipeline import count_train_examples, prepare_sft_data
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.train.collate import make_collator

REPO = Path(__file__).resolve().parents[2]
SEED = 1234  # train.seed of make_cfg


# ----------------------------------------------------------------------------------------------- helpers


def make_cfg(tmp_path: Path, **data) -> Config:
    """A typed config as the entry point makes it (schema, merged, converted); data keys as keyword arguments."""
    cfg = schema_for()
    cfg.model.name = cfg.logger.name = "test"
    cfg.data.name = "test"
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.max_seq_len = 64
    cfg.data.synthetic.num_train = 200
    cfg.data.synthetic.num_eval = 20
    cfg.train.seed = SEED
    merged = OmegaConf.merge(cfg, {"data": data})  # merge turns source dicts into typed DataSource nodes
    return OmegaConf.to_object(merged)


def data_settings(cfg: Config) -> dict:
    """cfg.data as plain values, to give make_cfg again."""
    return plain_tree(dataclasses.asdict(cfg.data))


def fresh(cfg, tmp_path: Path):
    """The same settings with an empty cache directory."""
    data = data_settings(cfg)
    data.pop("cache_dir")
    return make_cfg(tmp_path, **data)


def rows(n: int, tag: str = "q") -> list[dict[str, str]]:
    return [{"prompt": f"{tag} question {i}", "chosen": f"answer {i}", "rejected": f"wrong {i}"} for i in range(n)]


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def write_csv(path: Path, items: list[dict]) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(items[0]))
        writer.writeheader()
        writer.writerows(items)
    return path


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(ModelConfig(), DataConfig())


def decode_answer(tok, ex) -> str:
    return tok.decode([i for i, label in zip(ex["input_ids"], ex["labels"], strict=True) if label != -100])


# ----------------------------------------------------------------------------------------------- synthetic


def test_embedded_tokenizer(tok):
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert 256 < len(tok) <= 1024
    ids = tok(" Human: reverse the words: cat dog Assistant: dog cat<|endoftext|>")["input_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) < 20  # the task's words are single tokens
    size = sum(p.stat().st_size for p in (REPO / "ds_exp/assets/tokenizer").iterdir())
    assert size < 200_000


def test_embedded_tokenizer_rebuilds_identically():
    out = subprocess.run(
        [sys.executable, "-m", "ds_exp.assets.build_tokenizer", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_synthetic_default(tmp_path, tok):
    cfg = make_cfg(tmp_path)
    assert data_config_problems(cfg.data) == []
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert data.stats["num_train"] == len(data.train) == 200 == count_train_examples(cfg.data)
    assert data.stats["num_eval"] == len(data.eval) == 20
    assert data.stats["cache_hit"] is False and data.stats["num_truncated"] == 0
    assert data.train.column_names == ["input_ids", "labels"]
    ex = data.train[0]
    text = tok.decode(ex["input_ids"])
    assert text.startswith(" Human: ") and " Assistant: " in text and text.endswith("<|endoftext|>")
    # only the answer and the end-of-conversation token are trained on
    answer = text.split(" Assistant:", 1)[1]
    assert decode_answer(tok, ex) == answer
    # the same seed gives the same data, another seed another split/order
    again = prepare_sft_data(make_cfg(tmp_path / "b").data, tok, seed=SEED)
    assert again.train["input_ids"] == data.train["input_ids"]
    cfg.train.seed = 7
    assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).train["input_ids"] != data.train["input_ids"]


def test_synthetic_num_eval_0_means_no_eval_set(tmp_path, tok):
    """0 eval rows asked: every train row stays in train (no eval_fraction carved out), and the run is told that
    evaluation is off."""
    from ds_exp.data.checks import no_eval_note

    cfg = make_cfg(tmp_path, synthetic={"num_train": 200, "num_eval": 0})
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert len(data.train) == 200 == count_train_examples(cfg.data) and len(data.eval) == 0
    assert no_eval_note(cfg.data).startswith("no eval set (data.synthetic.num_eval=0): evaluation is off")


def test_synthetic_task_is_deterministic():
    from ds_exp.data.synthetic import generate

    train, evals = generate(50, 10, seed=3)
    assert (train, evals) == generate(50, 10, seed=3)
    assert train != generate(50, 10, seed=4)[0]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert generate(80, 10, seed=3)[1] == evals  # eval does not move with num_train


# ----------------------------------------------------------------------------------------------- sources


def _source(kind: str, tmp_path: Path) -> tuple[dict, int, int]:
    """(source entry, expected train rows, expected eval rows): 40 rows, +10 eval where the kind has one."""
    import datasets

    items, evals = rows(40), rows(10, "e")
    if kind == "json_array":
        (tmp_path / "d.json").write_text(json.dumps(items, indent=2))
        return {"path": str(tmp_path / "d.json")}, 36, 4
    if kind == "json_columns":
        cols = {k: [r[k] for r in items] for k in items[0]}
        (tmp_path / "d.json").write_text(json.dumps(cols))
        return {"path": str(tmp_path / "d.json")}, 36, 4
    if kind == "json_lines":  # DeepSpeed-Chat's .json files are often JSON lines
        return {"path": str(write_jsonl(tmp_path / "d.json", items))}, 36, 4
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", items)
        return {"path": str(path), "eval_path": str(write_jsonl(tmp_path / "e.jsonl", evals))}, 40, 10
    if kind == "csv":
        return {"path": str(write_csv(tmp_path / "d.csv", items))}, 36, 4
    if kind == "parquet":
        datasets.Dataset.from_list(items).to_parquet(str(tmp_path / "d.parquet"))
        return {"path": str(tmp_path / "d.parquet")}, 36, 4
    if kind == "arrow":
        datasets.Dataset.from_list(items).save_to_disk(str(tmp_path / "ds"))
        return {"path": str(tmp_path / "ds")}, 36, 4
    if kind == "arrow_dict":
        dd = datasets.DatasetDict(train=datasets.Dataset.from_list(items), test=datasets.Dataset.from_list(evals))
        dd.save_to_disk(str(tmp_path / "dd"))
        return {"path": str(tmp_path / "dd")}, 40, 10
    if kind == "dschat":
        (tmp_path / "dschat").mkdir()
        (tmp_path / "dschat/train.json").write_text(json.dumps(items))
        (tmp_path / "dschat/eval.json").write_text(json.dumps(evals))
        return {"path": str(tmp_path / "dschat"), "format": "dschat"}, 40, 10
    raise AssertionError(kind)


KINDS = [
    "json_array",
    "json_columns",
    "json_lines",
    "jsonl",
    "csv",
    "parquet",
    "arrow",
    "arrow_dict",
    "dschat",
]


@pytest.mark.parametrize("kind", KINDS)
def test_source_kinds(kind, tmp_path, tok):
    src, n_train, n_eval = _source(kind, tmp_path)
    cfg = make_cfg(tmp_path, sources=[src], eval_fraction=0.1)
    assert data_config_problems(cfg.data) == []
    assert count_train_examples(cfg.data) == n_train
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert (len(data.train), len(data.eval)) == (n_train, n_eval)
    trained = {decode_answer(tok, ex) for ex in data.train}
    held_out = {decode_answer(tok, ex) for ex in data.eval}
    assert all(a.startswith(" answer ") and a.endswith("<|endoftext|>") for a in trained | held_out)
    if n_eval == 4:  # carved out of the same rows: no overlap
        assert not trained & held_out


def test_field_mapping(tmp_path, tok):
    items = [{"question": f"q {i}", "response": f"r {i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "x.jsonl", items)
    cfg = make_cfg(tmp_path, sources=[{"path": str(path), "prompt_field": "question", "chosen_field": "response"}])
    cfg.data.eval_fraction = 0.0
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert len(data.train) == 10 and len(data.eval) == 0
    assert tok.decode(data.train[0]["input_ids"]).startswith(" Human: q ")


def test_rows_without_answer_are_filtered(tmp_path, tok):
    items = [*rows(10), {"prompt": "p", "chosen": ""}, {"prompt": None, "chosen": "x"}, {"chosen": "y"}]
    cfg = make_cfg(tmp_path, sources=[{"path": str(write_jsonl(tmp_path / "x.jsonl", items))}], eval_fraction=0)
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert len(data.train) == 10 and data.stats["num_filtered_rows"] == 3


# ----------------------------------------------------------------------------------------------- splits


def test_blend_splits_and_sft_only(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", rows(50, "a"))
    b, _, _ = _source("dschat", tmp_path)  # 40 train + 10 eval
    c = write_csv(tmp_path / "c.csv", rows(20, "c"))
    cfg = make_cfg(
        tmp_path,
        sources=[{"path": str(a)}, b],
        sft_only_sources=[{"path": str(c)}],
        data_split="2,4,4",
        eval_fraction=0.1,
    )
    # a: 20% of 50 = 10, 1 carved for eval; b: 20% of 40 = 8, eval 20% of 10 = 2; c: whole 20, 2 carved
    assert count_train_examples(cfg.data) == 9 + 8 + 18
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert (len(data.train), len(data.eval)) == (35, 1 + 2 + 2)
    assert [s["train"] for s in data.stats["per_source"]] == [9, 8, 18]
    prompts = [tok.decode(ex["input_ids"]).split()[1] for ex in data.train]
    assert prompts.count("a") == 9 and prompts.count("q") == 8 and prompts.count("c") == 18
    assert prompts != sorted(prompts)  # blended sources are shuffled together
    # reproducible for a seed (fresh cache), different for another
    same = prepare_sft_data(fresh(cfg, tmp_path / "2").data, tok, seed=SEED)
    assert same.stats["cache_hit"] is False and same.train["input_ids"] == data.train["input_ids"]
    cfg.train.seed = 99
    other = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert other.train["input_ids"] != data.train["input_ids"] and len(other.train) == 35


def test_split_arithmetic():
    from ds_exp.data.splits import eval_carve_count, parse_data_split, phase_bounds

    assert parse_data_split("2,4,4") == (2, 4, 4)
    assert phase_bounds(10, (2, 4, 4)) == [0, 2, 6, 10]
    assert phase_bounds(7, (10, 0, 0)) == [0, 7, 7, 7]
    assert eval_carve_count(100, 0.05) == 5 and eval_carve_count(3, 0.05) == 1 and eval_carve_count(1, 0.5) == 0
    for bad in ("1,2", "a,b,c", "0,1,1", "-1,1,1"):
        with pytest.raises(ValueError):
            parse_data_split(bad)


ALL_TO_SFT = [
    "10,0,0",
    "10, 0, 0",
    "10 0 0",
    "[10,0,0]",
    "(10, 0, 0)",
    [10, 0, 0],
    (10, 0, 0),
    [10.0, 0, 0],
    ["10", 0, 0],
]
NOT_A_SPLIT = [
    ("10", "got 1"),
    ("2,4", "got 2"),
    ([1, 2, 3, 4], "got 4"),
    (None, "got 1"),
    ("a,b,c", "must be numbers, got 'a'"),
    ([True, 0, 0], "must be numbers, got True"),
    ([[1], 0, 0], "must be numbers, got [1]"),
    ("0,5,5", "phase 1 (SFT) gets nothing"),
    ("1,-1,0", "numbers from 0 to 3.403e+38"),
    ("1e308,1e308,1e308", "numbers from 0 to 3.403e+38"),  # their sum would be inf
]


def test_every_natural_spelling_of_a_split_is_one_split_and_others_are_told_the_one_that_works():
    from ds_exp.data.splits import parse_data_split

    for spelling in ALL_TO_SFT:
        assert parse_data_split(spelling) == (10, 0, 0), spelling
    for spelling, what in NOT_A_SPLIT:
        with pytest.raises(ValueError) as err:
            parse_data_split(spelling)
        assert what in str(err.value) and "write data.data_split=10,0,0 (every row to SFT)" in str(err.value), err


@pytest.mark.parametrize("arg", ["data.data_split=2,4,4", "data.data_split=[2,4,4]", "data.data_split='2, 4, 4'"])
def test_a_split_on_the_command_line_is_one_value(arg, compose_cfg):
    """Unquoted, Hydra reads 2,4,4 as a sweep over 2, 4 and 4 ("Ambiguous value"): the CLI quotes it first."""
    from ds_exp.config.override_checks import quote_one_value_lists
    from ds_exp.data.splits import parse_data_split

    cfg = compose_cfg(*quote_one_value_lists([arg]))
    assert parse_data_split(cfg.data.data_split) == (2, 4, 4)


def test_only_a_split_is_quoted_and_real_sweeps_stay_sweeps():
    from ds_exp.config.override_checks import quote_one_value_lists

    kept = ["-m", "train.max_steps=1,2", "zero=stage2,stage3", "data.data_split='2,4,4','10,0,0'", "data.name=a,b"]
    kept += ["data.data_split=choice('2,4,4','10,0,0')", "data.data_split=[10,0,0]", "data.data_split=10"]
    assert quote_one_value_lists(kept) == kept
    assert quote_one_value_lists(["data.data_split=10,0,0", "+data.data_split=2, 4,4"]) == [
        "data.data_split='10,0,0'",
        "+data.data_split='2, 4,4'",
    ]


def data_line(caplog) -> str:
    return next(r.getMessage() for r in reversed(caplog.records) if r.getMessage().startswith("data: "))


def test_dschat_local_trains_on_every_row_unless_phases_are_asked_for(tmp_path, tok, caplog):
    """data=dschat_local gave SFT 20% of the file by default (DeepSpeed-Chat's "2,4,4"), saying nothing."""
    directory = dschat_dir(tmp_path)  # 50 train rows + 10 eval rows
    cfg = dschat_local_cfg(tmp_path, directory)
    assert count_train_examples(cfg.data) == 50
    with caplog.at_level("INFO", logger="ds_exp"):
        every = prepare_sft_data(cfg.data, tok, seed=SEED)
        assert (len(every.train), len(every.eval)) == (50, 10) and "phases 2 and 3" not in data_line(caplog)
        # DeepSpeed-Chat's phases, asked for: SFT gets phase 1's 20%, and the data line says what is left out
        phased = dschat_local_cfg(tmp_path, directory, data_split="2,4,4")
        assert count_train_examples(phased.data) == 10
        dschat = prepare_sft_data(phased.data, tok, seed=SEED)
        assert (len(dschat.train), len(dschat.eval)) == (10, 2)
        assert dschat.stats["cache_hit"] is False and dschat.stats["cache_path"] != every.stats["cache_path"]
        assert data_line(caplog).endswith(
            "; data.data_split=2,4,4 gives SFT (phase 1) 20% of each source: 40 train and 8 eval rows are left for "
            "phases 2 and 3 and not trained on (data.data_split=10,0,0 trains on every row)"
        )
        # another spelling of the same split is the same data: the same cache entry
        again = prepare_sft_data(dschat_local_cfg(tmp_path, directory, data_split=[10, 0, 0]).data, tok, seed=SEED)
        assert again.stats["cache_hit"] is True and again.stats["cache_path"] == every.stats["cache_path"]


@pytest.mark.parametrize("split", ["10,0,0", "2,4,4", "1,1,1", "3,0,7", "1,0,0.5"])
def test_the_count_and_the_pipeline_agree_on_every_split(split, tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", rows(37, "a"))
    b, _, _ = _source("dschat", tmp_path)  # 40 train + 10 eval
    c = write_csv(tmp_path / "c.csv", rows(11, "c"))
    cfg = make_cfg(tmp_path, sources=[{"path": str(a)}, b], sft_only_sources=[{"path": str(c)}], data_split=split)
    data = prepare_sft_data(cfg.data, tok, seed=SEED)
    assert count_train_examples(cfg.data) == len(data.train)
    per = data.stats["per_source"]
    assert sum(s["train"] + s["eval"] + s["later_phases_train"] + s["later_phases_eval"] for s in per) == 37 + 50 + 11
    assert per[2]["later_phases_train"] == per[2]["later_phases_eval"] == 0  # sft_only: used whole


def test_synthetic_split_arithmetic_and_parallel_tokenization(tmp_path, tok):
    cfg = make_cfg(tmp_path, data_split="2,4,4", synthetic={"num_train": 10000})
    assert count_train_examples(cfg.data) == 2000
    serial = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert len(serial.train) == 2000
    cfg.data.num_proc = 2  # does not change the result, so it is not part of the cache key
    assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).stats["cache_hit"] is True
    parallel = prepare_sft_data(fresh(cfg, tmp_path / "np").data, tok, seed=SEED)
    assert parallel.stats["cache_hit"] is False  # a fresh cache_dir: built with 2 processes
    assert parallel.train["input_ids"] == serial.train["input_ids"]
    assert parallel.train["labels"] == serial.train["labels"]


def test_max_eval_examples(tmp_path, tok):
    cfg = make_cfg(tmp_path, max_eval_examples=5)
    assert len(prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).eval) == 5


# ----------------------------------------------------------------------------------------------- cache


def test_cache_reuse_and_invalidation(tmp_path, tok, monkeypatch):
    path = write_jsonl(tmp_path / "x.jsonl", rows(30))
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}])
    first = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert first.stats["cache_hit"] is False
    assert (Path(first.stats["cache_path"]) / "train" / "dataset_info.json").is_file()
    assert not list(Path(cfg.data.cache_dir).glob("**/*.pkl"))

    import ds_exp.data.encode as encode

    def boom(*args, **kwargs):
        raise AssertionError("tokenized although the cache should have been used")

    with monkeypatch.context() as m:
        m.setattr(encode.Encoder, "__call__", boom)
        second = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
        assert second.stats["cache_hit"] is True and second.stats["cache_path"] == first.stats["cache_path"]
        assert second.train["input_ids"] == first.train["input_ids"]
        os.utime(path)  # touched, same content: still a hit (content fingerprint)
        assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).stats["cache_hit"] is True

    cfg.data.max_seq_len = 32  # a setting changes -> rebuilt elsewhere
    changed = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert changed.stats["cache_hit"] is False and changed.stats["cache_path"] != first.stats["cache_path"]
    cfg.data.max_seq_len = 64
    write_jsonl(path, rows(31))  # the file changes -> rebuilt
    grown = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert grown.stats["cache_hit"] is False and grown.stats["num_train"] + grown.stats["num_eval"] == 31
    cfg.data.train_on_prompt = True
    assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).stats["cache_hit"] is False


def test_the_default_cache_is_one_per_user_whatever_the_working_directory(tmp_path, tok, monkeypatch, compose_cfg):
    """data.cache_dir was .cache/ds_exp/data of the launch directory: a run from elsewhere tokenized again, and a
    run's export looked for its data where it was started. null (every data option's default) is the user's."""
    from ds_exp.config.paths import data_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    places = []
    for where in ("a", "b/c"):
        (tmp_path / where).mkdir(parents=True)
        monkeypatch.chdir(tmp_path / where)
        cfg = compose_cfg("data=synthetic", "data.synthetic.num_train=40", "data.synthetic.num_eval=4")
        assert cfg.data.cache_dir is None
        data = prepare_sft_data(cfg.data, tok, seed=SEED)
        places.append((Path(data.stats["cache_path"]).parent, data.stats["cache_hit"]))
    assert places == [(tmp_path / "xdg/ds_exp/data", False), (tmp_path / "xdg/ds_exp/data", True)]
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data_cache_dir(None) == Path.home() / ".cache/ds_exp/data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG rules say
    assert data_cache_dir(None) == Path.home() / ".cache/ds_exp/data"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_cache_dir("~/mine") == tmp_path / "home/mine"  # one set by hand: as given, ~ expanded


def test_broken_cache_entry_is_rebuilt(tmp_path, tok):
    cfg = make_cfg(tmp_path)
    first = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    for f in (Path(first.stats["cache_path"]) / "train").glob("*.arrow"):
        f.unlink()
    again = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert again.stats["cache_hit"] is False and again.train["input_ids"] == first.train["input_ids"]


CHILD = textwrap.dedent(
    """
    import json, sys, time, logging, pathlib
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from omegaconf import OmegaConf
    from ds_exp.config.schema import schema_for
    import ds_exp.data.encode as enc
    real = enc.encode
    def slow(*args, **kwargs):  # widen the window in which the other process must wait
        time.sleep(1.0)
        return real(*args, **kwargs)
    enc.encode = slow
    import ds_exp.core.waits as waits
    waits.NOTICE_S = 0.2  # the waiting process says so (at most 5 s in a run)
    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.tokenizer import load_tokenizer
    cfg = OmegaConf.to_object(OmegaConf.merge(schema_for(), OmegaConf.load(sys.argv[1])))
    tok = load_tokenizer(cfg.model, cfg.data)
    pathlib.Path(sys.argv[2] + "." + sys.argv[3]).touch()
    while not pathlib.Path(sys.argv[2]).exists():
        time.sleep(0.01)
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    first = data.train["input_ids"][:3]
    print(json.dumps({"hit": data.stats["cache_hit"], "train": first, "n": len(data.train)}))
    """
)


@pytest.mark.slow  # two processes build the same cache (a minute)
def test_concurrent_builds_share_one_cache(tmp_path):
    cfg = make_cfg(tmp_path)
    OmegaConf.save(cfg, tmp_path / "cfg.yaml")
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path / "cfg.yaml"), str(go), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both start prepare_sft_data together
    outs = [p.communicate(timeout=90) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["hit"] for r in results) == [False, True]  # exactly one build
    assert results[0]["train"] == results[1]["train"] and results[0]["n"] == results[1]["n"] == 200
    assert any("ds_exp: waiting for the tokenized data sft-" in err for _, err in outs)
    cache = Path(cfg.data.cache_dir)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1  # no temp directory left behind


# ----------------------------------------------------------------------------------------------- labels


def test_prompt_masking_and_train_on_prompt(tmp_path, tok):
    masked = prepare_sft_data(make_cfg(tmp_path).data, tok, seed=SEED)
    full = prepare_sft_data(make_cfg(tmp_path, train_on_prompt=True).data, tok, seed=SEED)
    for a, b in zip(masked.train.select(range(20)), full.train.select(range(20)), strict=True):
        assert a["input_ids"] == b["input_ids"] and b["labels"] == b["input_ids"]
        n_masked = a["labels"].count(-100)
        assert 0 < n_masked < len(a["labels"])
        assert a["labels"][:n_masked] == [-100] * n_masked  # a masked prefix, then the answer
        assert a["labels"][n_masked:] == a["input_ids"][n_masked:]
        assert tok.decode(a["input_ids"][:n_masked]).endswith(" Assistant:")


def test_collator_pads_to_longest_and_masks_pads(tmp_path, tok):
    data = prepare_sft_data(make_cfg(tmp_path).data, tok, seed=SEED)
    feats = [data.train[i] for i in range(8)]
    lengths = [len(f["input_ids"]) for f in feats]
    batch = make_collator(tok)(feats)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (8, max(lengths))
    for i, n in enumerate(lengths):
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["labels"][i, n:].eq(-100).all() and batch["input_ids"][i, n:].eq(tok.pad_token_id).all()
        assert batch["labels"][i, :n].tolist() == feats[i]["labels"]
    assert make_collator(tok, pad_to_multiple_of=16)(feats)["input_ids"].shape[1] % 16 == 0


def test_collator_with_pad_equal_to_eos_keeps_the_eos_label(tok):
    import copy

    same = copy.deepcopy(tok)
    same.pad_token = same.eos_token
    eos = same.eos_token_id
    feats = [
        {"input_ids": [5, 6, eos], "labels": [-100, 6, eos]},
        {"input_ids": [5, eos], "labels": [-100, eos]},
    ]
    batch = make_collator(same)(feats)
    assert batch["labels"].tolist() == [[-100, 6, eos], [-100, eos, -100]]
    assert batch["input_ids"].tolist() == [[5, 6, eos], [5, eos, eos]]


def test_truncation_is_counted(tmp_path, tok):
    items = [{"prompt": "p", "chosen": " ".join(["apple"] * n)} for n in (2, 30, 40, 50)]
    cfg = make_cfg(tmp_path, sources=[{"path": str(write_jsonl(tmp_path / "x.jsonl", items))}], eval_fraction=0)
    cfg.data.max_seq_len = 24
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert data.stats["num_truncated"] == 3 and max(len(x) for x in data.train["input_ids"]) == 24


def test_packing(tmp_path, tok):
    plain = prepare_sft_data(make_cfg(tmp_path).data, tok, seed=SEED)
    packed = prepare_sft_data(make_cfg(tmp_path, packing=True).data, tok, seed=SEED)
    assert len(packed.train) < len(plain.train) and len(packed.eval) == len(plain.eval)
    assert max(len(x) for x in packed.train["input_ids"]) <= 64
    flat = [t for x in packed.train["input_ids"] for t in x]
    assert flat == [t for x in plain.train["input_ids"] for t in x]  # same tokens, same order
    assert [t for x in packed.train["labels"] for t in x] == [t for x in plain.train["labels"] for t in x]
    ex = packed.train[0]
    starts = [i for i, p in enumerate(ex["position_ids"]) if p == 0]
    assert len(starts) > 1 and ex["labels"][starts[1]] == -100  # each packed example keeps its prompt mask
    batch = make_collator(tok)([packed.train[0], packed.train[1]])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    isolated = make_collator(tok, isolate_packed=True)([packed.train[0], packed.train[1]])
    assert set(isolated) == {"input_ids", "position_ids", "labels"}


def test_long_documents_tokenize_and_pack_in_memory_bounded_by_a_few_rows(tmp_path, tok, monkeypatch):
    """Token lists are Python objects (tens of bytes a token): tokenizing and packing hold a batch of rows and the
    row being filled, never the data set (at data.max_seq_len=1M a batch is one row). Here batches of 2 rows of up
    to 4096 tokens: Python's peak while preparing the data stays far below what the data set's tokens take."""
    import random
    import tracemalloc

    from ds_exp.data import encode

    monkeypatch.setattr(encode, "TOKENS_PER_BATCH", 2 * 4096, raising=False)
    words = random.Random(0).choices(["cat", "dog", "red", "blue", "sun", "tree"], k=120 * 800)
    items = [
        {"prompt": f"document {i}", "chosen": " ".join(words[i * 800 : (i + 1) * 800 - 50 * (i % 7)])}
        for i in range(120)
    ]
    path = write_jsonl(tmp_path / "long.jsonl", items)
    settings = {"sources": [{"path": str(path)}], "eval_fraction": 0, "packing": True}
    prepare_sft_data(make_cfg(tmp_path, max_seq_len=4000, **settings).data, tok, seed=SEED)  # imports done
    cfg = make_cfg(tmp_path, max_seq_len=4096, **settings)
    tracemalloc.start()
    try:
        data = prepare_sft_data(cfg.data, tok, seed=SEED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tokens = sum(len(x) for x in data.train["input_ids"])
    assert tokens > 100_000 and data.stats["num_examples_before_packing"] == 120 and len(data.train) < 60
    # measured: 1.4 MiB (a batch's token lists and offsets, the texts); 22 MiB when the whole set was held
    assert peak < 3 * 2**20, f"peak {peak / 2**20:.1f} MiB of Python objects for {tokens} tokens"
    plain = prepare_sft_data(make_cfg(tmp_path, **{**data_settings(cfg), "packing": False}).data, tok, seed=SEED)
    assert [t for x in data.train["input_ids"] for t in x] == [t for x in plain.train["input_ids"] for t in x]
    assert [t for x in data.train["labels"] for t in x] == [t for x in plain.train["labels"] for t in x]


def test_chat_template(tmp_path, tok):
    import copy

    chat = copy.deepcopy(tok)
    chat.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    data = prepare_sft_data(make_cfg(tmp_path, template="auto").data, chat, seed=SEED)
    assert data.stats["template"] == "chat_template"
    ex = data.train[0]
    assert tok.decode(ex["input_ids"]).startswith("<|user|>")
    assert decode_answer(chat, ex).endswith("<|endoftext|>") and "<|assistant|>" not in decode_answer(chat, ex)
    # the plain tokenizer has no template: auto falls back to DeepSpeed-Chat's format, chat_template fails
    assert prepare_sft_data(make_cfg(tmp_path, template="auto").data, tok, seed=SEED).stats["template"] == "dschat"
    with pytest.raises(DataError, match="no chat template"):
        prepare_sft_data(make_cfg(tmp_path, template="chat_template").data, tok, seed=SEED)


# ----------------------------------------------------------------------------------------------- errors


def _error(cfg, tok) -> str:
    with pytest.raises(DataError) as info:
        prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    return str(info.value)


def test_missing_file(tmp_path, tok):
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "nope.jsonl")}])
    [line] = data_config_problems(cfg.data)
    assert line.startswith(f"data.sources[0].path={tmp_path / 'nope.jsonl'}:") and "file not found" in line
    assert "file not found" in _error(cfg, tok)
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "a.jsonl"), "eval_path": str(tmp_path / "b")}])
    write_jsonl(tmp_path / "a.jsonl", rows(3))
    assert any(p.startswith("data.sources[0].eval_path=") for p in data_config_problems(cfg.data))


def test_unknown_format(tmp_path, tok):
    (tmp_path / "x.txt").write_text("hello\n")
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "x.txt")}])
    assert "unknown file extension '.txt'" in data_config_problems(cfg.data)[0]
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "x.txt"), "format": "xml"}])
    assert data_config_problems(cfg.data)[0].startswith("data.sources[0].format=xml: unknown format 'xml'")
    assert "unknown format" in _error(cfg, tok)


def test_missing_column_names_the_existing_ones(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "a", "answer": "b"}])
    msg = _error(make_cfg(tmp_path, sources=[{"path": str(path)}]), tok)
    assert msg.startswith("data.sources[0].prompt_field=prompt: column not found")
    assert "question, answer" in msg


def test_empty_after_filtering(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "chosen": " "}, {"prompt": "b", "chosen": None}])
    assert "empty after filtering" in _error(make_cfg(tmp_path, sources=[{"path": str(path)}]), tok)
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty" in _error(make_cfg(tmp_path, sources=[{"path": str(tmp_path / "empty.jsonl")}]), tok)


def test_invalid_json_names_file_and_line(tmp_path, tok):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b"}\n\n{"prompt": "c", "chosen": }\n')
    assert f"{path}:3: not valid JSON" in _error(make_cfg(tmp_path, sources=[{"path": str(path)}]), tok)
    arr = tmp_path / "y.json"
    arr.write_text('[\n  {"prompt": "a", "chosen": "b"},\n  {"prompt": "c" "chosen": "d"}\n]\n')
    assert f"{arr}:3: not valid JSON" in _error(make_cfg(tmp_path, sources=[{"path": str(arr)}]), tok)
    lst = tmp_path / "z.jsonl"
    lst.write_text('{"prompt": "a", "chosen": "b"}\n[1, 2]\n')
    assert f"{lst}:2: expected a JSON object" in _error(make_cfg(tmp_path, sources=[{"path": str(lst)}]), tok)


def test_split_leaving_phase1_empty(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", rows(5))
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], data_split="1,100,100")
    assert "leaves phase 1 (SFT) empty" in _error(cfg, tok)
    with pytest.raises(DataError, match="leaves phase 1"):
        count_train_examples(cfg.data)
    cfg.data.data_split = "0,5,5"
    assert data_config_problems(cfg.data)[0].startswith("data.data_split=0,5,5: phase 1")


def test_bad_settings_are_reported_by_key(tmp_path):
    cfg = make_cfg(tmp_path, sources=[{"path": "", "prompt_field": ""}], data_split="1,2", eval_fraction=1.5)
    cfg.data.max_seq_len = 0
    cfg.data.num_proc = 0
    problems = data_config_problems(cfg.data)
    for key in (
        "data.max_seq_len=0",
        "data.data_split=1,2",
        "data.eval_fraction=1.5",
        "data.num_proc=0",
        "data.sources[0].path",
    ):
        assert any(p.startswith(key) for p in problems), (key, problems)


def test_prompt_filling_max_seq_len(tmp_path, tok):
    items = [{"prompt": " ".join(["apple"] * 40), "chosen": "b"}] * 3
    cfg = make_cfg(tmp_path, sources=[{"path": str(write_jsonl(tmp_path / "x.jsonl", items))}], eval_fraction=0)
    cfg.data.max_seq_len = 16
    assert "no answer token is left" in _error(cfg, tok)


def test_bad_tokenizer_path(tmp_path):
    cfg = make_cfg(tmp_path)
    cfg.model.tokenizer = str(tmp_path / "no_tokenizer_here")
    with pytest.raises(DataError, match=r"^model.tokenizer="):
        load_tokenizer(cfg.model, cfg.data)


def test_end_of_conversation_token_is_added_when_missing(tmp_path):
    cfg = make_cfg(tmp_path, end_of_conversation_token="<|eot|>")
    tok = load_tokenizer(cfg.model, cfg.data)
    assert len(tok("<|eot|>", add_special_tokens=False)["input_ids"]) == 1
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert tok.decode(data.train[0]["input_ids"]).endswith("<|eot|>")


def test_hub_ids_are_recognized():
    from ds_exp.data.formats import resolve_format

    assert resolve_format("Dahoas/rm-static", "auto") == "hub"
    with pytest.raises(ValueError, match="file not found"):
        resolve_format("data/missing.jsonl", "auto")


# ----------------------------------------------------------------------------------------------- templates

CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"


@pytest.fixture(scope="session")
def chatml(tok):
    """The embedded tokenizer with SmolLM2's ChatML markup (and its default system prompt)."""
    import copy

    chat = copy.deepcopy(tok)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = CHATML
    return chat


def label_runs(tok, ex) -> list[str]:
    """The labelled tokens of an example, decoded per contiguous run."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(ex["input_ids"], ex["labels"], strict=True):
        if label != -100:
            runs.append([token]) if not previous else runs[-1].append(token)
        previous = label != -100
    return [tok.decode(run) for run in runs]


def dschat_rows(n: int, tag: str = "") -> list[dict[str, str]]:
    """Rows exactly as DeepSpeed-Chat's local train.json / Dahoas/rm-static hold them: markers in the prompt."""
    return [
        {
            "prompt": f" Human: I have {i} yellow foxs{tag} and buy 9 more. How many do I have? Assistant:",
            "chosen": f" You have {i + 9} yellow foxs{tag}.",
            "rejected": f" You have {i} yellow foxs{tag}.",
        }
        for i in range(n)
    ]


def dschat_dir(tmp_path: Path, n: int = 50, n_eval: int = 10) -> Path:
    directory = tmp_path / "dschat_data"
    directory.mkdir()
    (directory / "train.json").write_text(json.dumps(dschat_rows(n)))
    (directory / "eval.json").write_text(json.dumps(dschat_rows(n_eval, " (eval)")))
    return directory


def dschat_local_cfg(tmp_path: Path, path: Path, **overrides):
    """data=dschat_local as shipped in conf/data, pointed at `path`."""
    data = OmegaConf.to_container(OmegaConf.load(REPO / "conf/data/dschat_local.yaml"))
    data["sources"][0]["path"] = str(path)
    data.pop("cache_dir")
    return make_cfg(tmp_path, **{**data, **overrides})


def test_dschat_rows_are_trained_on_as_given(tmp_path, tok):
    cfg = dschat_local_cfg(tmp_path, dschat_dir(tmp_path))
    assert cfg.data.template.value == "raw" and cfg.data.data_split == "10,0,0"  # every row to SFT (issue 35 §2)
    assert count_train_examples(cfg.data) == 50
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert (len(data.train), len(data.eval)) == (50, 10) and data.stats["template"] == "raw"
    rows = {r["chosen"]: r for r in dschat_rows(50) + dschat_rows(10, " (eval)")}
    for ex in [*data.train, *data.eval]:
        text = tok.decode(ex["input_ids"])
        chosen = " You" + text.split(" You", 1)[1].removesuffix("<|endoftext|>")
        row = rows[chosen]
        # exactly DeepSpeed-Chat's prompt + chosen + eot: no second " Human:", no doubled space
        assert text == row["prompt"] + row["chosen"] + "<|endoftext|>"
        assert text.count("Human:") == 1 and "  " not in text
        assert label_runs(tok, ex) == [row["chosen"] + "<|endoftext|>"]
    full = prepare_sft_data(
        dschat_local_cfg(tmp_path, tmp_path / "dschat_data", train_on_prompt=True).data, tok, seed=SEED
    )
    assert all(ex["labels"] == ex["input_ids"] for ex in full.train)
    # the rejected column is carried with the rows (reward-model phases), as before
    from ds_exp.data.sources import load_source

    raw = load_source(cfg.data.sources[0], "data.sources[0]")
    assert raw.layout == "prompt_chosen" and raw.num_marked == 60
    assert raw.train.rejected[:2] == [r["rejected"] for r in dschat_rows(2)]


def test_a_typed_prompt_is_asked_in_the_markup_the_rows_carried(tmp_path, tok):
    """Rows that carry " Human: ... Assistant:" themselves train as given (raw); the model never saw unmarked text,
    so a typed question is wrapped in that markup (issue 35 §1: chat answered "" to every prompt), and a prompt
    already marked is kept as given (the README's eval.prompts)."""
    from ds_exp.data.templates import first_template, render_prompt

    data = prepare_sft_data(dschat_local_cfg(tmp_path, dschat_dir(tmp_path)).data, tok, seed=SEED)
    assert data.stats["template"] == "raw" and data.stats["per_source"][0]["markup"] == "dschat"
    asked = first_template(data.stats)
    assert asked == "dschat"  # what the export records for python -m ds_exp.chat and python -m ds_exp.evaluate
    trained = dschat_rows(4)[3]["prompt"]
    question = trained.removeprefix(" Human: ").removesuffix(" Assistant:")
    assert render_prompt(question, asked, tok) == (trained, True)
    assert render_prompt(trained, asked, tok) == (trained, True)  # marked already: not wrapped twice
    unmarked = write_jsonl(tmp_path / "plain.jsonl", rows(20))
    plain = prepare_sft_data(make_cfg(tmp_path, sources=[{"path": str(unmarked)}], template="raw").data, tok, seed=SEED)
    assert plain.stats["per_source"][0]["markup"] is None and first_template(plain.stats) == "raw"


def test_dschat_step1_trains_on_the_text_as_given(tmp_path):
    from ds_exp.config.paths import conf_dir
    from ds_exp.config.schema import register_configs

    hydra = pytest.importorskip("hydra")
    register_configs()
    try:
        with hydra.initialize_config_dir(str(conf_dir()), version_base=None):
            cfg = hydra.compose("config", overrides=["experiment=dschat_step1", "data=dschat_local"])
            plain = hydra.compose("config", overrides=["experiment=dschat_step1"])
    except Exception as err:  # the rest of the conf tree is someone else's and may be mid-change
        pytest.skip(f"root config does not compose: {err}")
    assert cfg.data.template.value == plain.data.template.value == "raw"
    assert cfg.data.sources[0].layout == "prompt_chosen"


@pytest.mark.parametrize("template", ["dschat", "chat_template"])
def test_marked_rows_are_refused_by_wrapping_templates(template, tmp_path, tok, chatml):
    directory = dschat_dir(tmp_path)
    cfg = dschat_local_cfg(tmp_path, directory, template=template)
    msg = _error(cfg, chatml if template == "chat_template" else tok)
    assert msg.startswith("data.sources[0]: all 60 rows already carry DeepSpeed-Chat's markers")
    assert f"{directory / 'train.json'}: item 0" in msg and "data.template=raw" in msg
    with pytest.raises(DataError, match=r"data\.template=raw"):
        count_train_examples(cfg.data)  # the dry run says so too


def test_auto_picks_raw_for_marked_rows(tmp_path, chatml, caplog):
    plain = write_jsonl(tmp_path / "plain.jsonl", rows(20))
    directory = dschat_dir(tmp_path)
    cfg = dschat_local_cfg(tmp_path, directory, template="auto", data_split="10,0,0")
    cfg = make_cfg(tmp_path, **{**data_settings(cfg), "sources": [{"path": str(directory)}, {"path": str(plain)}]})
    with caplog.at_level("INFO", logger="ds_exp"):
        data = prepare_sft_data(cfg.data, chatml, seed=cfg.train.seed)
    assert "data.template=auto uses raw for this source" in caplog.text
    assert data.stats["template"] == "raw+chat_template"
    assert [s["template"] for s in data.stats["per_source"]] == ["raw", "chat_template"]
    texts = [chatml.decode(ex["input_ids"]) for ex in data.train]
    marked = [t for t in texts if "Human:" in t]
    assert len(marked) == 50 and not any("<|im_start|>" in t for t in marked)
    assert all(t.startswith(DEFAULT_SYSTEM) for t in texts if t not in marked)


CHAT_ROWS = {
    "messages": lambda i, system: {
        "messages": [
            *([{"role": "system", "content": "Be brief."}] if system else []),
            {"role": "user", "content": f"hi {i}"},
            {"role": "assistant", "content": f"hello {i}"},
            {"role": "user", "content": "and now?"},
            {"role": "assistant", "content": f"bye {i}"},
        ]
    },
    "sharegpt": lambda i, system: {
        "conversations": [
            *([{"from": "system", "value": "Be brief."}] if system else []),
            {"from": "human", "value": f"hi {i}"},
            {"from": "gpt", "value": f"hello {i}"},
            {"from": "human", "value": "and now?"},
            {"from": "gpt", "value": f"bye {i}"},
        ]
    },
}


def _chat_expected(system: bool, i: int, chat: bool) -> tuple[str, list[str]]:
    if chat:
        head = "<|im_start|>system\nBe brief.<|im_end|>\n" if system else DEFAULT_SYSTEM
        text = (
            f"{head}<|im_start|>user\nhi {i}<|im_end|>\n<|im_start|>assistant\nhello {i}<|im_end|>\n"
            f"<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\nbye {i}<|im_end|>\n"
        )
        return text, [f"hello {i}<|im_end|>", f"bye {i}<|im_end|>"]
    text = f"{'Be brief.' if system else ''} Human: hi {i} Assistant: hello {i} Human: and now? Assistant: bye {i}"
    return text + "<|endoftext|>", [f" hello {i}", f" bye {i}<|endoftext|>"]


@pytest.mark.parametrize("chat", [False, True], ids=["embedded-dschat", "chatml"])
@pytest.mark.parametrize("layout", ["messages", "sharegpt"])
def test_multi_turn_chat_rows(layout, chat, tmp_path, tok, chatml):
    tokenizer = chatml if chat else tok
    items = [CHAT_ROWS[layout](i, system=i % 2 == 0) for i in range(12)]
    path = write_jsonl(tmp_path / "chat.jsonl", items)
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], template="auto", eval_fraction=0, max_seq_len=128)
    assert count_train_examples(cfg.data) == 12
    data = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed)
    assert data.stats["per_source"][0]["layout"] == layout
    assert data.stats["template"] == ("chat_template" if chat else "dschat")
    for ex in data.train:
        text = tokenizer.decode(ex["input_ids"])
        i = int(text.split("hello ", 1)[1].split("<", 1)[0].split(" ", 1)[0])
        expected, labels = _chat_expected(i % 2 == 0, i, chat)
        assert text == expected
        # every answer (and the end of turn right after it) counts; no system, user or header token does
        assert label_runs(tokenizer, ex) == labels


@pytest.mark.parametrize("chat", [False, True], ids=["embedded-dschat", "chatml"])
def test_alpaca_rows(chat, tmp_path, tok, chatml):
    tokenizer = chatml if chat else tok
    items = [{"instruction": "Add the numbers.", "input": f"{i} 2", "output": f"{i + 2}"} for i in range(5)]
    items += [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(5, 8)]
    items.append({"instruction": "Nothing to learn.", "input": "", "output": " "})  # blank answer: dropped
    (tmp_path / "alpaca.json").write_text(json.dumps(items))
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "alpaca.json")}], template="auto", eval_fraction=0)
    assert count_train_examples(cfg.data) == 8
    data = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed)
    assert data.stats["per_source"][0]["layout"] == "alpaca" and data.stats["num_filtered_rows"] == 1
    seen = set()
    for ex in data.train:
        text = tokenizer.decode(ex["input_ids"])
        answer = label_runs(tokenizer, ex)
        assert len(answer) == 1
        out = answer[0].removesuffix("<|im_end|>" if chat else "<|endoftext|>").strip()
        i = int(out) - 2 if "Add" in text else int(out)
        prompt = f"Add the numbers.\n\n{i} 2" if i < 5 else f"Say {i}."
        if chat:
            turns = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{out}<|im_end|>\n"
            assert text == DEFAULT_SYSTEM + turns
            assert answer == [f"{out}<|im_end|>"]
        else:
            assert text == f" Human: {prompt} Assistant: {out}<|endoftext|>"
            assert answer == [f" {out}<|endoftext|>"]
        seen.add(i)
    assert seen == set(range(8))


def test_raw_template_on_chat_rows(tmp_path, tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT_ROWS["messages"](i, system=True) for i in range(4)])
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], template="raw", eval_fraction=0)
    for ex in prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).train:
        text = tok.decode(ex["input_ids"])
        i = text.split("hello ", 1)[1][0]
        assert text == f"Be brief.hi {i}hello {i}and now?bye {i}<|endoftext|>"  # contents as given
        assert label_runs(tok, ex) == [f"hello {i}", f"bye {i}<|endoftext|>"]


def test_layout_is_detected_and_part_of_the_cache_key(tmp_path, tok):
    items = [{"prompt": f"p {i}", "chosen": f"c {i}", **CHAT_ROWS["messages"](i, system=False)} for i in range(6)]
    path = write_jsonl(tmp_path / "both.jsonl", items)
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], eval_fraction=0)
    chat = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)  # a messages column wins over prompt/chosen
    assert "Human: hi" in tok.decode(chat.train[0]["input_ids"])
    cfg.data.sources[0].layout = "prompt_chosen"
    pairs = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert pairs.stats["cache_hit"] is False and tok.decode(pairs.train[0]["input_ids"]).startswith(" Human: p ")
    renamed = make_cfg(tmp_path, sources=[{"path": str(path), "prompt_field": "chosen", "chosen_field": "prompt"}])
    from ds_exp.data.sources import load_source

    assert load_source(renamed.data.sources[0], "data.sources[0]").layout == "prompt_chosen"  # renamed fields win


def test_chat_rows_with_parallel_tokenization(tmp_path, chatml):
    items = [CHAT_ROWS["sharegpt"](i, system=i % 3 == 0) for i in range(1500)]
    path = write_jsonl(tmp_path / "chat.jsonl", items)
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], template="auto", eval_fraction=0, max_seq_len=128)
    serial = prepare_sft_data(cfg.data, chatml, seed=cfg.train.seed)
    cfg.data.num_proc = 2
    parallel = prepare_sft_data(fresh(cfg, tmp_path / "np").data, chatml, seed=SEED)
    assert parallel.train["input_ids"] == serial.train["input_ids"]
    assert parallel.train["labels"] == serial.train["labels"]


def test_chat_template_rejecting_a_row_names_it(tmp_path, tok):
    import copy

    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    items = [CHAT_ROWS["messages"](i, system=i == 3) for i in range(5)]
    path = write_jsonl(tmp_path / "chat.jsonl", items)
    msg = _error(make_cfg(tmp_path, sources=[{"path": str(path)}], template="chat_template"), strict)
    assert msg.startswith(f"data.sources[0]: {path}:4: the tokenizer's chat template rejects this conversation")
    assert "no system role" in msg and "data.template=dschat" in msg


BAD_TURNS = [
    ({"messages": [{"role": "bot", "content": "x"}]}, "turn 0 has unknown role 'bot'"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ["y"]}]},
        "turn 1 (assistant) content is list, not a string",
    ),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]}, "content is int"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown role 'narrator'"),
]


@pytest.mark.parametrize("bad,expect", BAD_TURNS, ids=[e.split(" (")[0] for _, e in BAD_TURNS])
def test_bad_chat_rows_name_file_and_row(bad, expect, tmp_path, tok):
    column = next(iter(bad))
    good = CHAT_ROWS["messages" if column == "messages" else "sharegpt"](0, system=False)
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, bad, good])
    msg = _error(make_cfg(tmp_path, sources=[{"path": str(path)}]), tok)
    assert msg.startswith(f"data.sources[0]: {path}:3: ") and expect in msg, msg
    array = tmp_path / "chat.json"
    array.write_text(json.dumps([good, bad]))
    msg = _error(make_cfg(tmp_path, sources=[{"path": str(array)}]), tok)
    assert msg.startswith(f"data.sources[0]: {array}: item 1: ") and expect in msg, msg
    with pytest.raises(DataError, match=":3: "):
        count_train_examples(make_cfg(tmp_path, sources=[{"path": str(path)}]).data)


def test_bad_alpaca_row_and_layout_settings(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": 5.5}])
    assert _error(make_cfg(tmp_path, sources=[{"path": str(path)}]), tok).startswith(
        f"data.sources[0]: {path}:2: 'output' is float, not a string"
    )
    cfg = make_cfg(tmp_path, sources=[{"path": str(path), "layout": "xml"}])
    assert data_config_problems(cfg.data) == [
        "data.sources[0].layout=xml: unknown row layout; use one of auto, prompt_chosen, messages, sharegpt, alpaca"
    ]
    msg = _error(make_cfg(tmp_path, sources=[{"path": str(path), "layout": "messages"}]), tok)
    assert msg.startswith("data.sources[0].layout=messages:") and "no 'messages' column" in msg
    assert data_config_problems(make_cfg(tmp_path, template="raw").data) == []


def test_single_conversation_json_file(tmp_path, tok):
    (tmp_path / "one.json").write_text(json.dumps(CHAT_ROWS["messages"](7, system=False)))
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "one.json")}], eval_fraction=0)
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert len(data.train) == 1 and label_runs(tok, data.train[0]) == [" hello 7", " bye 7<|endoftext|>"]


# ----------------------------------------------------------------------------------------------- wiring


def test_package_import_is_light():
    heavy = "('torch', 'datasets', 'transformers')"
    code = f"import sys, ds_exp.data; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("option", ["synthetic", "local", "dschat_local", "blend"])
def test_conf_data_options_compose(option, tmp_path):
    from ds_exp.config.paths import conf_dir
    from ds_exp.config.schema import register_configs

    hydra = pytest.importorskip("hydra")
    register_configs()
    try:
        with hydra.initialize_config_dir(str(conf_dir()), version_base=None):
            cfg = hydra.compose("config", overrides=[f"data={option}"])
    except Exception as err:  # the rest of the conf tree is someone else's and may be mid-change
        pytest.skip(f"root config does not compose: {err}")
    assert cfg.data.name == option
    try:  # as the entry point: unset (???) source paths are reported while converting
        problems = data_config_problems(to_config(cfg).data)
    except ConfigError as err:
        problems = err.problems
    if option == "synthetic":
        assert problems == [] and cfg.data.max_seq_len <= 128
    else:  # paths are mandatory (???) and reported by key
        assert problems and all(p.startswith("data.sources[") and "is not set" in p for p in problems)


# ----------------------------------------------------------------------------------------------- files (issue 14)


def _read_error(path: Path, **src) -> str:
    from ds_exp.data.sources import load_source

    with pytest.raises(DataError) as info:
        load_source(DataSource(path=str(path), **src), "data.sources[0]")
    return str(info.value)


def _read(path: Path, **src) -> list[list[str]]:
    from ds_exp.data.sources import load_source

    return load_source(DataSource(path=str(path), **src), "data.sources[0]").train.contents


ONE = '{"prompt": "a", "chosen": "b"}'
REPEATED = [
    # (file name, content, where, repeated key)
    ("x.jsonl", f'{ONE}\n\n{{"prompt": "a", "prompt": "b", "chosen": "c"}}\n', "x.jsonl:3", "prompt"),
    ("x.jsonl", '\n{"prompt": "a", "chosen": "b", "chosen": "c"}\n', "x.jsonl:2", "chosen"),  # one record
    ("x.json", f'[{ONE}, {{"prompt": "a", "chosen": "b", "prompt": "c"}}]', "x.json: item 1", "prompt"),
    ("x.json", f'{{"data": [{ONE}, {ONE}, {{"prompt": "", "prompt": "c"}}]}}', "x.json: item 2", "prompt"),
    ("x.json", '{"prompt": ["a"], "chosen": ["b"], "prompt": ["c"]}', "x.json:1", "prompt"),  # columns
    (
        "x.jsonl",
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})[:-3]
        + ', "content": "b"}]}\n',
        "x.jsonl:1",
        "content",
    ),
]


@pytest.mark.parametrize(("name", "content", "where", "key"), REPEATED)
def test_a_key_repeated_in_one_json_object_is_refused(name, content, where, key, tmp_path):
    (tmp_path / name).write_text(content)
    msg = _read_error(tmp_path / name)
    assert msg == (
        f"data.sources[0]: {tmp_path / where}: the key {key!r} appears twice in one object (JSON would keep only "
        "the last value); remove or rename one of them"
    )


def test_the_same_key_in_different_objects_is_fine(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "chosen": "b", "meta": {"prompt": "c"}}] * 3)
    assert _read(path) == [["a", "b"]] * 3


def test_a_repeated_csv_column_is_refused(tmp_path):
    (tmp_path / "x.csv").write_text("prompt,chosen,prompt,chosen,extra\na,b,c,d,e\n")
    msg = _read_error(tmp_path / "x.csv")
    assert msg == (
        f"data.sources[0]: {tmp_path / 'x.csv'}: the columns prompt, chosen appear more than once in the header; "
        "rename the columns so each name is unique"
    )


@pytest.mark.parametrize("name", ["x.jsonl", "x.json", "x.csv"])
def test_a_utf8_byte_order_mark_is_dropped_and_noted_once(name, tmp_path, caplog):
    from ds_exp.data import textfiles

    items = rows(20)
    if name == "x.csv":
        write_csv(tmp_path / name, items)
    elif name == "x.json":
        (tmp_path / name).write_text(json.dumps(items))
    else:
        write_jsonl(tmp_path / name, items)
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    textfiles._noted_bom.discard(str(path))
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], eval_fraction=0)
    with caplog.at_level("INFO", logger="ds_exp.data.textfiles"):
        assert count_train_examples(cfg.data) == 20 == count_train_examples(cfg.data)
    assert _read(path)[0] == ["q question 0", "answer 0"]  # the first column keeps its name
    notes = [r.getMessage() for r in caplog.records if "byte order mark" in r.getMessage()]
    assert notes == [f"{path} starts with a UTF-8 byte order mark (as Windows tools write it); it is ignored"]


@pytest.mark.parametrize("name", ["x.jsonl.gz", "x.json.gz", "x.csv.gz", "x.ndjson.GZ", "x.CSV.GZ"])
def test_gzip_files_are_read_transparently(name, tmp_path, tok):
    import gzip

    plain = tmp_path / name[: -len(".gz")]
    items = rows(30)
    if plain.suffix.lower() == ".csv":
        write_csv(plain, items)
    elif plain.suffix == ".json":
        plain.write_text(json.dumps(items))
    else:
        write_jsonl(plain, items)
    path = tmp_path / name
    path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + plain.read_bytes()))  # a BOM inside is dropped too
    cfg = make_cfg(tmp_path, sources=[{"path": str(path)}], eval_fraction=0)
    assert data_config_problems(cfg.data) == []
    assert _read(path) == _read(plain)
    explicit = {"csv": "csv", "json": "json", "jsonl": "jsonl", "ndjson": "jsonl"}[name.split(".")[1].lower()]
    assert _read(path, format=explicit) == _read(plain)
    data = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert len(data.train) == 30


def test_formats_with_gzip_extensions():
    from ds_exp.data.formats import extension, looks_like_hub_id

    assert extension("a/b.v2.JSONL.gz") == ".jsonl.gz" and extension("x.tar.gz") == ".tar.gz"
    assert extension("data") == "" and extension("d.jsonl") == ".jsonl"
    assert not looks_like_hub_id("train.jsonl.gz") and looks_like_hub_id("org/name")


def test_an_unknown_compound_extension_is_named(tmp_path):
    (tmp_path / "x.tar.gz").write_bytes(b"\x1f\x8b")
    cfg = make_cfg(tmp_path, sources=[{"path": str(tmp_path / "x.tar.gz")}])
    assert "unknown file extension '.tar.gz'" in data_config_problems(cfg.data)[0]


def _binary(kind: str, path: Path) -> None:
    import gzip
    import zipfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "gzip":
        path.write_bytes(gzip.compress(b'{"prompt": "a", "chosen": "b"}\n'))
    elif kind == "parquet":
        pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"]}), path)
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("x.jsonl", '{"prompt": "a", "chosen": "b"}\n')
    elif kind == "utf16":
        path.write_text('{"prompt": "a", "chosen": "b"}\n', encoding="utf-16")
    elif kind == "latin1":
        path.write_bytes('{"prompt": "café", "chosen": "b"}\n'.encode("latin-1"))


BINARY = [
    ("gzip", "x.jsonl", "x.jsonl is gzip-compressed, not JSON text; rename it to x.jsonl.gz"),
    ("gzip", "x.csv", "x.csv is gzip-compressed, not CSV text; rename it to x.csv.gz"),
    ("parquet", "x.jsonl", "x.jsonl is a Parquet file, not JSON text; rename it to x.parquet, or set format=parquet"),
    ("parquet", "x.csv", "x.csv is a Parquet file, not CSV text"),
    ("zip", "x.json", "x.json is a zip archive, not JSON text; unzip it"),
    ("utf16", "x.jsonl", "x.jsonl is UTF-16 text, not JSON text; save it as UTF-8"),
    ("latin1", "x.jsonl", "x.jsonl is not UTF-8 text (invalid continuation byte at byte 15)"),
]


@pytest.mark.parametrize(("kind", "name", "expect"), BINARY, ids=[f"{k}-{n}" for k, n, _ in BINARY])
def test_a_file_that_is_not_text_says_what_it_is(kind, name, expect, tmp_path):
    _binary(kind, tmp_path / name)
    assert f"data.sources[0]: {tmp_path}/{expect}" in _read_error(tmp_path / name)


def test_a_gz_file_that_is_not_gzip_or_is_cut_short(tmp_path):
    import gzip

    write_jsonl(tmp_path / "x.jsonl.gz", rows(3))
    msg = _read_error(tmp_path / "x.jsonl.gz")
    assert msg.endswith("x.jsonl.gz is named .gz but is not gzip-compressed; rename it to x.jsonl")
    (tmp_path / "y.jsonl.gz").write_bytes(gzip.compress(json.dumps(rows(200)).encode())[:50])
    msg = _read_error(tmp_path / "y.jsonl.gz")
    assert "y.jsonl.gz is a damaged gzip file (" in msg and msg.endswith("; compress or copy it again")


def test_json_lines_break_only_at_newlines(tmp_path):
    # U+2028 and U+0085 are line breaks to str.splitlines() but plain characters inside JSON strings
    line = json.dumps({"prompt": "a\u2028b", "chosen": "c\x85d"}, ensure_ascii=False) + "\r\n"
    (tmp_path / "x.jsonl").write_text(line * 2)
    assert _read(tmp_path / "x.jsonl") == [["a\u2028b", "c\x85d"]] * 2


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = make_cfg(tmp_path)
    cfg.data.cache_dir = str(tmp_path / "file")
    assert data_config_problems(cfg.data) == [
        f"data.cache_dir={tmp_path / 'file'} is a file, not a directory; point data.cache_dir at a directory"
    ]
    cfg.data.cache_dir = str(tmp_path / "file" / "cache")
    assert data_config_problems(cfg.data) == [
        f"data.cache_dir={tmp_path / 'file' / 'cache'}: {tmp_path / 'file'} is a file, not a directory; point "
        "data.cache_dir at a directory"
    ]
    cfg.data.cache_dir = str(tmp_path / "not_yet" / "cache")  # made when the cache is built
    assert data_config_problems(cfg.data) == []


def test_a_full_disk_while_writing_the_cache_is_one_message(tmp_path, tok, mount_tmpfs):
    disk = mount_tmpfs("1m")
    stat = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 64 * 1024))  # 64 KiB left
    cfg = make_cfg(tmp_path, eval_fraction=0)
    cfg.data.synthetic.num_train = 2000  # about 0.5 MB of Arrow
    cfg.data.cache_dir = str(disk / "cache")
    msg = _error(cfg, tok)
    assert msg.startswith(f"data.cache_dir={disk / 'cache'}: the disk is full (")
    assert msg.endswith(
        " free) while writing the tokenized cache; free some space or point data.cache_dir at a larger disk"
    )
    assert [p.name for p in (disk / "cache").iterdir() if not p.name.endswith(".lock")] == []  # no partial build
    (disk / "filler").unlink()
    assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).stats["cache_hit"] is False  # room again: it builds


def test_a_full_disk_is_recognised_through_wrappers(tmp_path):
    import errno

    from ds_exp.data.cache import disk_full, disk_full_message

    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("could not save") from inner
    except RuntimeError as outer:
        assert disk_full(outer) == errno.EDQUOT
        assert "the disk quota is used up" in disk_full_message(outer, tmp_path / "cache")
    assert disk_full(ValueError("pyarrow: IOError: No space left on device")) == errno.ENOSPC
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full_message(ValueError("bad row"), tmp_path) is None


def _chat(n: int, start: int = 0) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(start, start + n)
    ]


def _sharegpt(n: int) -> list[dict]:
    return [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in range(n)]


def test_a_file_mixing_row_layouts_says_which_rows_are_which_and_how_to_choose(tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [*_chat(5), *_sharegpt(3), *_chat(2, 5)])
    assert _read_error(mixed) == (
        f"data.sources[0]: {mixed} mixes row layouts: messages at lines 1-5, 9-10 (7 rows); sharegpt at lines 6-8 (3 "
        "rows). One source reads one layout: set data.sources.0.layout=messages (or sharegpt) to train on those rows "
        "only, skipping the others, or split the file into one source per layout"
    )
    assert len(_read(mixed, layout="messages")) == 7 and len(_read(mixed, layout="sharegpt")) == 3  # chosen: skipped
    pairs = [*rows(2), {"instruction": "do x", "output": "done"}]
    as_json = tmp_path / "mixed.json"
    as_json.write_text(json.dumps(pairs))
    assert "mixes row layouts: prompt_chosen at items 0-1 (2 rows); alpaca at item 2 (1 row)" in _read_error(as_json)
    # one layout per row, however many columns: a row with both prompt and messages is a messages row (ultrachat)
    both = write_jsonl(tmp_path / "both.jsonl", [{**row, "prompt": "q"} for row in _chat(3)])
    assert len(_read(both)) == 3


def test_an_empty_eval_split_is_refused_with_its_fixes(tmp_path):
    dschat = tmp_path / "dschat"
    dschat.mkdir()
    (dschat / "train.json").write_text(json.dumps(rows(4)))
    for empty in ("", "[]"):
        (dschat / "eval.json").write_text(empty)
        assert _read_error(dschat) == (
            f"data.sources[0]: {dschat / 'eval.json'} holds no eval rows; add eval rows to it, delete it, or set "
            "data.sources.0.eval_split=null to hold out data.eval_fraction of the train rows for eval instead"
        )
    assert len(_read(dschat, eval_split=None)) == 4
    train, evals = write_jsonl(tmp_path / "t.jsonl", rows(4)), tmp_path / "e.jsonl"
    evals.write_text("")
    assert "e.jsonl holds no eval rows; add eval rows to it, or remove data.sources.0.eval_path" in _read_error(
        train, eval_path=str(evals)
    )


def test_eval_rows_that_repeat_train_rows_are_counted_and_said(tmp_path, tok, caplog):
    """Issue 39 §6: an eval.json equal to train.json (or eval rows copied from train) measures recall: said."""
    train = write_jsonl(tmp_path / "train.jsonl", rows(40))
    same = make_cfg(tmp_path, sources=[{"path": str(train), "eval_path": str(train)}])
    with caplog.at_level(logging.WARNING, logger="ds_exp"):
        data = prepare_sft_data(same.data, tok, seed=same.train.seed)
    assert data.stats["num_eval_in_train"] == len(data.eval) == 40
    assert "40 of the 40 eval examples are also train examples (the eval set repeats the training data)" in caplog.text
    partly = write_jsonl(tmp_path / "eval.jsonl", rows(3) + rows(5, tag="held-out"))
    cfg = make_cfg(tmp_path, sources=[{"path": str(train), "eval_path": str(partly)}])
    assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).stats["num_eval_in_train"] == 3
    apart = make_cfg(tmp_path, sources=[{"path": str(train)}], eval_fraction=0.1)  # carved out: never repeated
    assert prepare_sft_data(apart.data, tok, seed=apart.train.seed).stats["num_eval_in_train"] == 0


@pytest.mark.parametrize(
    "entry", ['{"format": 1, "acc": 0.5}', "[1, 2]", '{"key": "x", "created": 1, "stats": {}}', "{"]
)
def test_a_cache_entry_of_another_shape_is_a_miss_built_again(entry, tmp_path, tok, caplog):
    """Issue 39 §3: a cache entry ds_exp did not write (another shape, cut short) is rebuilt and said, never a crash."""
    cfg = make_cfg(tmp_path)
    first = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    meta = Path(first.stats["cache_path"]) / "meta.json"
    meta.write_text(entry)
    with caplog.at_level(logging.WARNING, logger="ds_exp"):
        again = prepare_sft_data(cfg.data, tok, seed=cfg.train.seed)
    assert not again.stats["cache_hit"] and len(again.train) == len(first.train)
    assert f"cache entry {meta} is not what ds_exp writes" in caplog.text
    assert prepare_sft_data(cfg.data, tok, seed=cfg.train.seed).stats["cache_hit"]
