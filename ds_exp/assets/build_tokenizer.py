"""Rebuild the embedded tokenizer: `python -m ds_exp.assets.build_tokenizer [--out DIR] [--check]`.

A byte-level BPE (GPT-2 style: any text encodes, nothing is unknown) trained with `tokenizers` on the embedded
synthetic task, so its words are single tokens and the default model stays tiny. Deterministic: the same
corpus, one training thread and sorted JSON give byte-identical files (`--check` verifies the shipped copy)."""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds_exp.config.paths import embedded_tokenizer_dir
from ds_exp.core.files import json_text
from ds_exp.data.synthetic import corpus

VOCAB_SIZE = 512  # 256 byte symbols + 2 special tokens + merges; a multiple of 8 as the model's embedding
EOS = "<|endoftext|>"  # DeepSpeed-Chat's end-of-conversation token, the eos
PAD = "<|pad|>"  # a separate pad token: padding is masked by position anyway, but a distinct id reads clearer
CORPUS_ROWS = 20000
MODEL_MAX_LENGTH = 2048  # the tiny model's max_position_embeddings does not matter here; keep a finite bound
# Frequent English words, so the merges left after the synthetic vocabulary go to text users will try first
# (local JSON demos, chat prompts) instead of the vocabulary stopping short of VOCAB_SIZE.
COMMON_TEXT = """
the of and to in is you that it he was for on are as with his they at be this have from or one had by word
but not what all were we when your can said there use an each which she do how their if will up other about
out many then them these so some her would make like him into time has look two more write go see number no
way could people my than first water been call who oil its now find long down day did get come made may part
over new sound take only little work know place year live me back give most very after thing our just name
good sentence man think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large must big even such
because turn here why ask went men read need land different home us move try kind hand picture again change
off play spell air away animal house point page letter mother answer found study still learn should world
question what which who where when why how please thanks hello yes explain write list describe summarize
"""


def build(out_dir: Path) -> None:
    # One rayon thread: BPE merge ties are then broken the same way on every machine.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The common words are repeated so their merges outrank rare byte pairs of the synthetic corpus.
    texts = corpus(CORPUS_ROWS, seed=0) + [" ".join(COMMON_TEXT.split()) + " . , ? !"] * 200
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    # Written by hand (not save_pretrained) so the files do not change with the transformers version.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json_text(config, indent=2, sort_keys=True) + "\n")
    special = {"eos_token": EOS, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json_text(special, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=embedded_tokenizer_dir(), help="output directory")
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    args = parser.parse_args(argv)
    if not args.check:
        build(args.out)
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        names = sorted(p.name for p in Path(tmp).iterdir())
        _, mismatch, errors = filecmp.cmpfiles(tmp, args.out, names, shallow=False)
    if mismatch or errors:
        print(f"{args.out} differs from a fresh build: {mismatch + errors}", file=sys.stderr)
        return 1
    print(f"{args.out} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
