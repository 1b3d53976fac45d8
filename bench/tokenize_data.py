"""ds_exp's data step on a large synthetic set: cold cache, cached re-run, a bare `datasets.map`, peak memory.

* ds_exp: `prepare_sft_data` (generate, split, blend, tokenize, save Arrow, load back) with the embedded
  tokenizer on `data.synthetic.num_train=N` (100k; quick: 5k), in a fresh process per measurement
  (`bench/tokenize_probe.py`): first on an empty cache directory (cold), then again on the same one (cached).
* bare: the same rows (train + eval, from ds_exp's synthetic generator) through `Dataset.from_list(...)
  .map(batched=True)` with the same tokenizer and the same per-row work (dschat template, tokenization with
  offsets, labels masked over the prompt), without splits, cache or save; with 1 process (what a plain script
  does) and with as many as ds_exp picks for this size (2 on a 2-core machine at 100k rows).
* Memory: each process's peak RSS (ru_maxrss, nothing subtracted), its RSS right before the step (VmRSS:
  imports, config and tokenizer) and the peak of the worker processes the step waited for (RUSAGE_CHILDREN,
  blank when no child of the step outgrew the helper process that `import datasets` already waited for).
  ds_exp stores unpadded token lists (padding happens per batch in the collator), so its step's RSS does not
  grow with data.max_seq_len: a cold run at max_seq_len=512 is set beside DeepSpeed-Chat's padded layout
  (input_ids + attention_mask as int64 tensors of max_seq_len per row).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import run, stats, table, write_result

LONG_MAX_SEQ_LEN = 512  # the synthetic rows are <= 32 tokens: 8x the default 64 changes nothing but padding


def probe(work: Path, name: str, mode: str, num_train: int, *args: str) -> dict[str, Any]:
    """One measurement in a fresh process (see bench/tokenize_probe.py); adds the process's wall time."""
    out = work / f"{name}.json"
    wall, _ = run(
        [sys.executable, "-m", "bench.tokenize_probe", mode, str(num_train), str(out), *args],
        cwd=work,
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    return {**json.loads(out.read_text()), "process_s": wall}


def padded_bytes(rows: int, max_seq_len: int) -> int:
    """DeepSpeed-Chat's in-memory layout: input_ids and attention_mask padded to max_seq_len, int64."""
    return rows * max_seq_len * 2 * 8


def workers_mib(sample: dict[str, Any]) -> float | None:
    """Peak RSS of the worker processes the step waited for; None when no child of the step beat the import's."""
    after, before = sample["children_peak_rss_kib"], sample["children_peak_rss_kib_before"]
    return after / 1024 if after > before else None


def main(quick: bool = False) -> dict[str, Any]:
    from ds_exp.data.encode import pick_num_proc

    num_train = 5_000 if quick else 100_000
    reps = 1 if quick else 2
    procs = pick_num_proc(None, num_train)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "cached": [], "bare_1": [], f"bare_{procs}": []}
    with tempfile.TemporaryDirectory(prefix="ds_exp_bench_tokenize_") as tmp:
        work = Path(tmp)
        for i in range(reps):
            cache = f"data.cache_dir={work / f'cache{i}'}"
            runs["cold"].append(probe(work, f"cold{i}", "ds_exp", num_train, cache))
            runs["cached"].append(probe(work, f"cached{i}", "ds_exp", num_train, cache))
        runs[f"bare_{procs}"] += [probe(work, f"bare{procs}_{i}", "bare", num_train, str(procs)) for i in range(reps)]
        if procs != 1:
            runs["bare_1"].append(probe(work, "bare1", "bare", num_train, "1"))
        long = probe(
            work,
            "long",
            "ds_exp",
            num_train,
            f"data.cache_dir={work / 'cache_long'}",
            f"data.max_seq_len={LONG_MAX_SEQ_LEN}",
        )
    runs = {k: v for k, v in runs.items() if v}

    first = runs["cold"][0]
    rows = first["train"]["rows"] + first["eval"]["rows"]
    tokens = first["train"]["tokens"] + first["eval"]["tokens"]
    bare_tokens = runs[f"bare_{procs}"][0]["train"]["tokens"]
    labels = {
        "cold": f"ds_exp cold cache ({procs} proc)",
        "cached": "ds_exp cached re-run",
        f"bare_{procs}": f"bare datasets.map, num_proc={procs}",
        "bare_1": "bare datasets.map, 1 process",
    }
    summary: dict[str, Any] = {}
    table_rows = []
    for key, samples in runs.items():
        step = stats([s["step_s"] for s in samples])
        proc = stats([s["process_s"] for s in samples])
        last = samples[-1]
        increase_mib = (last["peak_rss_kib"] - last["rss_before_kib"]) / 1024
        summary[key] = {"step_s": step, "process_s": proc, "samples": samples}
        table_rows.append(
            [
                labels[key],
                step["median"],
                step["min"],
                proc["median"],
                rows / step["median"],
                last["rss_before_kib"] / 1024,
                last["peak_rss_kib"] / 1024,
                increase_mib,
                workers_mib(last),
            ]
        )
    headers = [
        "data step",
        "step s (median)",
        "step s (min)",
        "process s",
        "rows/s",
        "RSS before MiB",
        "peak RSS MiB",
        "step increase MiB",
        "workers peak MiB",
    ]
    print(f"{rows:,} rows ({num_train:,} train + eval), {tokens:,} tokens; bare map produced {bare_tokens:,} tokens\n")
    print(table(headers, table_rows))

    default_len = first["max_seq_len"]
    memory_rows = []
    for label, sample in (
        (f"ds_exp cold, max_seq_len={default_len}", first),
        (f"ds_exp cold, max_seq_len={LONG_MAX_SEQ_LEN}", long),
    ):
        memory_rows.append(
            [
                label,
                (sample["peak_rss_kib"] - sample["rss_before_kib"]) / 1024,
                sample["peak_rss_kib"] / 1024,
                sample["train"]["tokens"] + sample["eval"]["tokens"],
                sample["cache_bytes"] / 2**20,
                padded_bytes(rows, sample["max_seq_len"]) / 2**20,
            ]
        )
    print()
    print(
        table(
            [
                "run",
                "step increase MiB",
                "peak RSS MiB",
                "tokens stored",
                "Arrow cache MiB",
                "padded int64 ids+mask would be MiB",
            ],
            memory_rows,
        )
    )
    payload = {
        "num_train": num_train,
        "rows": rows,
        "tokens": tokens,
        "bare_tokens": bare_tokens,
        "num_proc": procs,
        "runs": summary,
        "long_max_seq_len": {**long, "padded_bytes": padded_bytes(rows, LONG_MAX_SEQ_LEN)},
        "padded_bytes_default": padded_bytes(rows, default_len),
    }
    write_result("tokenize_data", payload)
    return payload


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
