"""`prepare_sft_data` and `count_train_examples`: sources -> splits -> blend -> tokenize -> cached Arrow, as
DeepSpeed-Chat step 1 minus its defects (seeded phases, a held-out eval_fraction, no label on padding)."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from ds_exp.config.paths import data_cache_dir
from ds_exp.config.schema import DataConfig, DataSource, plain
from ds_exp.core.errors import DataError
from ds_exp.data.cache import cached_build, disk_full_message, hash_key, path_fingerprint
from ds_exp.data.checks import data_config_problems
from ds_exp.data.encode import Encoder, encode, end_of_conversation, pack, without_bars
from ds_exp.data.formats import expand, resolve_format
from ds_exp.data.sources import RawSource, Rows, find_row, load_source, synthetic_source
from ds_exp.data.splits import eval_carve_count, left_for_later_phases, parse_data_split, phase1_count, shown_split
from ds_exp.data.templates import RowError, resolve_template, row_markup, source_template, special_strings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Bump when the stored layout changes; the code of these modules is hashed into the key as well.
CACHE_VERSION = 2  # 2: rows are conversations (layouts), per-source templates (raw)
_CODE_FILES = ("synthetic", "sources", "textfiles", "conversations", "templates", "splits", "encode", "pipeline")


@dataclass
class SFTData:
    train: datasets.Dataset  # input_ids, labels (+ position_ids when packed), unpadded int lists
    eval: datasets.Dataset  # input_ids, labels; may hold 0 rows (eval_fraction=0, no eval splits)
    stats: dict[str, Any] = field(default_factory=dict)


def _sources(data: DataConfig) -> list[tuple[DataSource | None, str, bool]]:
    """(source config or None for synthetic, config key, sft_only) in blend order."""
    listed: list[tuple[DataSource | None, str, bool]] = [
        (s, f"data.sources[{i}]", False) for i, s in enumerate(data.sources)
    ]
    listed += [(s, f"data.sft_only_sources[{i}]", True) for i, s in enumerate(data.sft_only_sources)]
    return listed or [(None, "data.synthetic", False)]


def plan_counts(
    key: str, n_train: int, n_eval: int | None, sft_only: bool, split: tuple[float, float, float], frac: float
) -> tuple[int, int, int]:
    """(train rows, eval rows taken from the eval split, eval rows carved from train) of one source."""
    share = n_train if sft_only else phase1_count(n_train, split)
    if share == 0:
        raise DataError(
            f"{key}: data.data_split={shown_split(split)} leaves phase 1 (SFT) empty for its "
            f"{n_train} rows; give phase 1 a larger share (e.g. 10,0,0) or add rows"
        )
    if n_eval is not None:
        return share, n_eval if sft_only else phase1_count(n_eval, split), 0
    carve = eval_carve_count(share, frac)
    return share - carve, 0, carve


def _rng(seed: int, *tags: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**32, *tags])


def split_and_blend(
    raws: list[tuple[RawSource, bool]], data: DataConfig, seed: int
) -> tuple[Rows, Rows, list[dict[str, Any]]]:
    split = parse_data_split(data.data_split)
    frac = float(data.eval_fraction)
    train, evals, per_source = Rows(), Rows(), []
    for raw, sft_only in raws:
        n_eval = len(raw.eval) if raw.eval is not None else None
        n_tr, n_ev, n_carve = plan_counts(raw.key, len(raw.train), n_eval, sft_only, split, frac)
        # one seeded permutation for every source, as DeepSpeed-Chat (its index files depend on the seed only)
        perm = _rng(seed, 0).permutation(len(raw.train))[: n_tr + n_carve]
        evals.extend(raw.train.take(perm[:n_carve]))
        train.extend(raw.train.take(perm[n_carve:]))
        if raw.eval is not None:
            evals.extend(raw.eval.take(_rng(seed, 0).permutation(len(raw.eval))[:n_ev]))
        per_source.append(
            {
                "source": raw.key,
                "train": n_tr,
                "eval": n_ev + n_carve,
                # rows of DeepSpeed-Chat's phases 2 and 3: not trained on (the data line says so)
                "later_phases_train": 0 if sft_only else len(raw.train) - n_tr - n_carve,
                "later_phases_eval": 0 if sft_only or n_eval is None else n_eval - n_ev,
                "filtered": raw.num_filtered,
                "layout": raw.layout,
                "template": raw.template,
                "markup": row_markup(raw),  # the rows' own: how a typed prompt is asked (templates.first_template)
            }
        )
    train = train.take(_rng(seed, 1).permutation(len(train)))  # blend: concatenate, then shuffle
    evals = evals.take(_rng(seed, 2).permutation(len(evals)))
    max_eval = data.max_eval_examples
    if max_eval is not None and len(evals) > max_eval:
        evals = evals.take(range(max_eval))
    return train, evals, per_source


def count_train_examples(data: DataConfig) -> int:
    """SFT train examples after splits, without tokenizing (at most: packing and dropped rows make fewer)."""
    problems = data_config_problems(data)
    if problems:
        raise DataError("\n".join(problems))
    split = parse_data_split(data.data_split)
    frac = float(data.eval_fraction)
    # without a tokenizer auto stays undecided; dschat / chat_template still refuse rows with markers
    configured = str(plain(data.template))
    total = 0
    for src, key, sft_only in _sources(data):
        n_eval: int | None
        if src is None:
            syn = data.synthetic
            n_train, n_eval = int(syn.num_train), int(syn.num_eval)
        else:
            raw = load_source(src, key)
            if configured != "auto":
                source_template(configured, configured, raw)
            n_train, n_eval = len(raw.train), len(raw.eval) if raw.eval is not None else None
        total += plan_counts(key, n_train, n_eval, sft_only, split, frac)[0]
    return total


def save_quietly(ds: datasets.Dataset, path: Path, **options: Any) -> None:
    """save_to_disk without datasets' "Saving the dataset" bar: the tokenizing bars said what is happening."""
    with without_bars():
        ds.save_to_disk(str(path), **options)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    parts: dict[str, Any] = {"class": type(tok).__name__}
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)  # runtime state that tokenizing with max_length changes
        spec.pop("padding", None)
        parts["backend"] = hash_key(spec)
    else:
        parts["vocab"] = hash_key(sorted(tok.get_vocab().items()))
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "padding_side"):
        parts[name] = str(getattr(tok, name, None))
    parts["added"] = sorted((str(k), int(v)) for k, v in getattr(tok, "added_tokens_encoder", {}).items())
    parts["chat_template"] = getattr(tok, "chat_template", None)
    return hash_key(parts)


def _source_material(src: DataSource | None, key: str) -> dict[str, Any]:
    if src is None:
        return {"synthetic": True}
    names = ("format", "layout", "split", "eval_split", "prompt_field", "chosen_field", "name", "revision")
    material: dict[str, Any] = {name: getattr(src, name) for name in names}
    path = src.path
    try:
        fmt = resolve_format(path, src.format)
    except ValueError as err:
        raise DataError(f"{key}.path={path}: {err}") from None
    if fmt == "hub":  # no content fingerprint: the hub revision (if pinned) stands for it
        material["path"] = path
        return material
    local = expand(path).resolve()
    material.update(path=str(local), content=path_fingerprint(local))
    eval_path = src.eval_path
    if eval_path:
        material.update(eval_path=str(expand(eval_path).resolve()), eval_content=path_fingerprint(expand(eval_path)))
    return material


def cache_material(
    data: DataConfig, seed: int, tokenizer: PreTrainedTokenizerBase, template: str, eot: str
) -> dict[str, Any]:
    """Everything the tokenized result depends on."""
    material: dict[str, Any] = {
        "version": CACHE_VERSION,
        "code": hash_key([(f"{n}.py", (Path(__file__).resolve().parent / f"{n}.py").read_text()) for n in _CODE_FILES]),
        "sources": [(key, sft_only, _source_material(src, key)) for src, key, sft_only in _sources(data)],
        "data_split": list(parse_data_split(data.data_split)),
        "eval_fraction": float(data.eval_fraction),
        "max_eval_examples": data.max_eval_examples,
        "seed": int(seed),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": int(data.max_seq_len),
        "template": template,
        "template_setting": str(plain(data.template)),  # auto and explicit differ on marked rows
        "end_of_conversation": eot,
        "train_on_prompt": bool(data.train_on_prompt),
        "packing": bool(data.packing),
    }
    if not (data.sources or data.sft_only_sources):
        syn = data.synthetic
        material["synthetic"] = {"num_train": syn.num_train, "num_eval": syn.num_eval, "seed": syn.seed}
    return material


def _row_error(data: DataConfig, problem: str, roles: list[str], contents: list[str]) -> DataError:
    """A row the template cannot render, named by source and file:line (the rows are read again to find it)."""
    fix = "use data.template=dschat or a tokenizer whose chat template accepts it"
    for src, key, _ in _sources(data):
        if src is None:
            return DataError(f"data.synthetic: {problem}; {fix}")
        where = find_row(src, key, roles, contents)
        if where is not None:
            return DataError(f"{key}: {where}: {problem}; fix or remove the row, or {fix}")
    return DataError(f"{problem} (turns: {', '.join(roles)}); {fix}")


def _empty(columns: tuple[str, ...]) -> datasets.Dataset:
    features = datasets.Features({k: datasets.List(datasets.Value("int32")) for k in columns})
    return datasets.Dataset.from_dict({k: [] for k in columns}, features=features)


def _unpaired(data: DataConfig, rows: Rows) -> DataError | None:
    """A row without a rejected answer where pairs are trained on (a hub source, read only now), named."""
    i = next((i for i, r in enumerate(rows.rejected) if r is None or not r.strip()), None)
    if i is None:
        return None
    for src, key, _ in _sources(data):
        where = find_row(src, key, rows.roles[i], rows.contents[i]) if src is not None else None
        if where is not None:
            return DataError(f"{key}: {where}: no rejected answer; pairs are trained on: add one or remove the row")
    return DataError("a row has no rejected answer; pairs are trained on: add one or remove the row")


def prepare_sft_data(
    data: DataConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int, pairs: bool = False
) -> SFTData:
    """Tokenized train/eval sets, cached per settings; `seed` picks the phase split, eval carve-out and blend order;
    with `pairs`, chosen and rejected rows. Safe from every rank and sweep job at once."""
    problems = data_config_problems(data)
    if problems:
        raise DataError("\n".join(problems))
    configured = str(plain(data.template))
    template = resolve_template(configured, tokenizer)
    eot = end_of_conversation(data.end_of_conversation_token, tokenizer)
    material = cache_material(data, seed, tokenizer, template, eot)
    if pairs:
        material["pairs"] = True
    key = f"{'pairs' if pairs else 'sft'}-{hash_key(material)}"
    max_seq_len = int(data.max_seq_len)

    def build(tmp: Path) -> dict[str, Any]:
        raws = [
            (synthetic_source(data.synthetic) if src is None else load_source(src, key_), sft_only)
            for src, key_, sft_only in _sources(data)
        ]
        for raw, _ in raws:
            raw.set_template(source_template(configured, template, raw))
        train_rows, eval_rows, per_source = split_and_blend(raws, data, seed)
        # eval rows that are, turn for turn, a train row too (an eval.json that repeats train.json)
        seen = {(tuple(r), tuple(c)) for r, c in zip(train_rows.roles, train_rows.contents, strict=True)}
        in_train = sum((tuple(r), tuple(c)) in seen for r, c in zip(eval_rows.roles, eval_rows.contents, strict=True))
        unpaired = _unpaired(data, train_rows) or _unpaired(data, eval_rows) if pairs else None
        if unpaired is not None:
            raise unpaired
        encoder = Encoder(
            tokenizer, eot, max_seq_len, bool(data.train_on_prompt), special_strings(tokenizer), pairs=pairs
        )
        num_proc = data.num_proc
        work = tmp / "work"  # tokens stream through Arrow files here, not memory; removed once saved
        work.mkdir()
        try:
            train, train_counts = encode(train_rows, encoder, num_proc=num_proc, desc="train", work_dir=work)
            if len(eval_rows):
                evals, eval_counts = encode(eval_rows, encoder, num_proc=num_proc, desc="eval", work_dir=work)
            else:
                evals, eval_counts = _empty(encoder.token_columns), {"truncated": 0, "dropped": 0}
        except RowError as err:
            raise _row_error(data, *err.args) from None
        if len(train) == 0:
            raise DataError(
                f"data.max_seq_len={max_seq_len}: every train prompt fills it, so no answer token is left to "
                "train on; raise data.max_seq_len"
            )
        stats: dict[str, Any] = {
            "num_examples_before_packing": len(train),
            "num_truncated_train": train_counts["truncated"],
            "num_truncated_eval": eval_counts["truncated"],
            "num_dropped_no_labels": train_counts["dropped"] + eval_counts["dropped"],
            "num_filtered_rows": sum(p["filtered"] for p in per_source),
            "num_eval_in_train": in_train,
            "per_source": per_source,
            "template": "+".join(dict.fromkeys(raw.template for raw, _ in raws)),
        }
        if data.packing:
            train = pack(train, max_seq_len, work_dir=work)
        save_quietly(train, tmp / "train")
        save_quietly(evals, tmp / "eval", num_shards=1)  # an empty set needs its one (empty) shard
        del train, evals
        shutil.rmtree(work)
        return stats

    def load(directory: Path) -> tuple[datasets.Dataset, datasets.Dataset]:
        return datasets.load_from_disk(str(directory / "train")), datasets.load_from_disk(str(directory / "eval"))

    cache_dir = data_cache_dir(data.cache_dir)
    try:
        (train, evals), meta, hit, path = cached_build(cache_dir, key, build, load, material)
    except DataError:
        raise
    except Exception as err:  # the partial build directory is removed by cached_build
        message = disk_full_message(err, cache_dir)
        if message is None:
            raise
        raise DataError(message) from err
    stats = dict(meta["stats"])
    stats.update(
        num_train=len(train),
        num_eval=len(evals),
        num_truncated=stats["num_truncated_train"] + stats["num_truncated_eval"],
        cache_hit=hit,
        cache_path=str(path),
    )
    if stats["num_truncated"]:
        log.warning(
            "%d examples (%d train, %d eval) were longer than data.max_seq_len=%d and were truncated",
            stats["num_truncated"],
            stats["num_truncated_train"],
            stats["num_truncated_eval"],
            max_seq_len,
        )
    if stats["num_dropped_no_labels"]:
        log.warning(
            "%d examples had no answer token left within data.max_seq_len=%d and were dropped",
            stats["num_dropped_no_labels"],
            max_seq_len,
        )
    if stats.get("num_eval_in_train"):
        repeated, evals_n = stats["num_eval_in_train"], stats["num_eval"]
        log.warning(
            "%d of the %d eval examples are also train examples%s: their eval loss measures recall of what was "
            "trained, not generalisation; hold out rows the training data does not have",
            repeated,
            evals_n,
            " (the eval set repeats the training data)" if repeated == evals_n else "",
        )
    left = left_for_later_phases(
        parse_data_split(data.data_split),
        sum(s["later_phases_train"] for s in stats["per_source"]),
        sum(s["later_phases_eval"] for s in stats["per_source"]),
    )
    log.info(
        "data: %d train / %d eval examples, %s (%s %s)%s",
        stats["num_train"],
        stats["num_eval"],
        ", ".join(f"{s['source']}: {s['layout']} rows, template {s['template']}" for s in stats["per_source"]),
        "cache hit" if hit else "built",
        path,
        f"; {left}" if left else "",
    )
    return SFTData(train, evals, stats)
