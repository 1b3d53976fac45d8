"""`python -m ds_exp.universal TAG_DIR`: convert one complete checkpoint to DeepSpeed's universal format ahead of a
resume that changes its layout; one line per refusal (ds_exp/checkpoint/universal.py does the work)."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from ds_exp.checkpoint import universal
from ds_exp.checkpoint.universal import conversion_status, convert_here, require_complete
from ds_exp.config.command_line import shell_word
from ds_exp.core.errors import ResumeError
from ds_exp.launch.console import entry_point
from ds_exp.launch.flags import FlagParser, path, whole
from ds_exp.resume.store import COMPLETE_MARKER, step_dirs

MAX_WORKERS = 256  # processes DeepSpeed's conversion starts: more than the machine has only queue
log = logging.getLogger(universal.__name__)  # the conversion's own lines: shown on stderr by main()


def cli_target(path: Path) -> Path:
    """The checkpoint the command line names, or a message saying what to name instead."""
    if not path.exists():
        raise ResumeError(f"{path} does not exist; give one checkpoint directory, e.g. <run>/checkpoints/step<N>")
    if not path.is_dir():
        raise ResumeError(f"{path} is a file; give one checkpoint directory, e.g. <run>/checkpoints/step<N>")
    if re.fullmatch(r"step\d+", path.name) or (path / COMPLETE_MARKER).exists() or any(path.glob("*model_states.pt")):
        return path  # a checkpoint, complete or not (convert_here refuses an incomplete one)
    for holder in (path, path / "checkpoints"):
        tags = [t.name for t in step_dirs(holder)]
        if tags:
            return _name_one(path, holder, tags)
    raise ResumeError(f"{path} holds no checkpoint; give one checkpoint directory, e.g. <run>/checkpoints/step<N>")


def _name_one(path: Path, holder: Path, tags: list[str]) -> Path:
    shown = ", ".join(tags[:8]) + (" ..." if len(tags) > 8 else "")
    raise ResumeError(
        f"{path} is {'a checkpoints directory' if holder == path else 'a run directory'}, not one checkpoint: it "
        f"holds {shown}; convert one of them, e.g. python -m ds_exp.universal {shell_word(str(holder / tags[-1]))}"
    )


@entry_point("ds_exp.universal")
def main(argv: list[str] | None = None) -> int:
    """`python -m ds_exp.universal TAG_DIR`: convert a checkpoint ahead of a resume that changes its layout."""
    parser = FlagParser(
        prog="python -m ds_exp.universal",
        description="Convert one complete ds_exp checkpoint into DeepSpeed's universal format, cached beside it as "
        "<tag>.universal/, ahead of a resume with another world size, ZeRO stage or offload (a resume converts by "
        "itself otherwise, while the other ranks wait). A conversion that is there and matches the checkpoint is "
        "reused; a stale one is replaced.",
    )
    parser.add_argument("checkpoint", type=path, help="one checkpoint directory: <run dir>/checkpoints/step<N>")
    parser.add_argument(
        "--workers", type=whole(1, MAX_WORKERS), default=2, help="DeepSpeed's extraction processes (default 2)"
    )
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ds_exp.universal: %(message)s"))
    log.addHandler(handler)
    level, log.propagate = log.level, False
    log.setLevel(logging.INFO)
    try:
        tag_dir = cli_target(args.checkpoint).resolve()
        require_complete(tag_dir)
        reused, stale = conversion_status(tag_dir)
        if reused:
            log.info("%s is converted already (its fingerprint matches)", tag_dir)
        else:
            if stale:
                log.warning("%s; converting it again", stale)
            log.info("converting %s to DeepSpeed's universal format ...", tag_dir)
        print(convert_here(tag_dir, workers=args.workers))
    except ResumeError as err:
        message = str(err).removeprefix("resume: ")
        print(f"ds_exp.universal: error: {message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("ds_exp.universal: interrupted; nothing was converted or left behind", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
