"""One measurement of `bench.tokenize_data`, in a fresh process: `python -m bench.tokenize_probe MODE N OUT [ARGS]`.

MODE ds_exp: compose the config (data.synthetic.num_train=N plus ARGS as overrides), load_tokenizer, then time
  prepare_sft_data: ds_exp's whole data step (generate, split, blend, tokenize, save Arrow, load it back),
  or a cache hit when OUT's cache directory already holds the same settings.
MODE bare: the same synthetic rows (train + eval, from ds_exp's generator) through `Dataset.from_list(...).map(
  batched=True)` with the same tokenizer and the same work per row: the dschat template, one tokenization with
  offsets, labels masked over the prompt. No splits, no cache, no save. ARGS: num_proc (default: 1).

Writes a JSON object to OUT: wall seconds of the step, RSS (KiB) right before it, peak RSS of this process
(ru_maxrss, RUSAGE_SELF) and of its waited-for children (RUSAGE_CHILDREN: the tokenizer workers of num_proc > 1,
before and after the step), and what was produced.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import compose, rss_kib

IGNORE_INDEX = -100


def token_counts(ds: Any) -> dict[str, int]:
    """Rows and stored tokens of a tokenized set, read from its Arrow column (no Python lists)."""
    import pyarrow.compute as pc

    column = ds.data.column("input_ids")
    return {"rows": len(ds), "tokens": int(pc.sum(pc.list_value_length(column)).as_py() or 0)}


def ds_exp_step(num_train: int, overrides: list[str]) -> tuple[float, int, dict[str, Any]]:
    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.tokenizer import load_tokenizer

    cfg = compose(f"data.synthetic.num_train={num_train}", *overrides)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    before = rss_kib()
    started = time.perf_counter()
    data = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed)
    elapsed = time.perf_counter() - started
    train, evals = token_counts(data.train), token_counts(data.eval)
    info = {
        "cache_hit": bool(data.stats["cache_hit"]),
        "train": train,
        "eval": evals,
        "max_seq_len": int(cfg.data.max_seq_len),
        "num_proc_setting": cfg.data.num_proc,
        "cache_bytes": sum(p.stat().st_size for p in Path(data.stats["cache_path"]).rglob("*") if p.is_file()),
    }
    return elapsed, before, info


def bare_step(num_train: int, num_proc: int) -> tuple[float, int, dict[str, Any]]:
    import datasets

    from ds_exp.data.synthetic import generate

    cfg = compose(f"data.synthetic.num_train={num_train}")
    from ds_exp.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.data)
    max_len, eos = int(cfg.data.max_seq_len), tokenizer.eos_token
    syn = cfg.data.synthetic

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        heads = [f" Human: {p} Assistant:" for p in batch["prompt"]]
        texts = [f"{h} {c}{eos}" for h, c in zip(heads, batch["chosen"], strict=True)]
        enc = tokenizer(texts, truncation=True, max_length=max_len, return_offsets_mapping=True)
        labels = []
        for head, ids, offsets in zip(heads, enc["input_ids"], enc["offset_mapping"], strict=True):
            n_prompt = next((j for j, (s, e) in enumerate(offsets) if s >= len(head) and e > s), len(ids))
            labels.append([IGNORE_INDEX] * n_prompt + ids[n_prompt:])
        return {"input_ids": enc["input_ids"], "labels": labels}

    before = rss_kib()
    started = time.perf_counter()
    train, eval_rows = generate(int(num_train), int(syn.num_eval), int(syn.seed))
    rows = [{"prompt": r["prompt"], "chosen": r["chosen"]} for r in (*train, *eval_rows)]
    ds = datasets.Dataset.from_list(rows).map(
        encode, batched=True, num_proc=num_proc if num_proc > 1 else None, remove_columns=["prompt", "chosen"]
    )
    elapsed = time.perf_counter() - started
    return elapsed, before, {"train": token_counts(ds), "max_seq_len": max_len, "num_proc": num_proc}


def main() -> None:
    mode, num_train, out, *args = sys.argv[1:]
    # `import datasets` itself waits for a helper process (~120 MiB): remember the children's peak before the step
    import datasets  # noqa: F401

    children_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if mode == "ds_exp":
        elapsed, before, info = ds_exp_step(int(num_train), args)
    else:
        elapsed, before, info = bare_step(int(num_train), int(args[0]) if args else 1)
    result = {
        "mode": mode,
        "step_s": elapsed,
        "rss_before_kib": before,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "children_peak_rss_kib_before": children_before,
        "children_peak_rss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        **info,
    }
    Path(out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
