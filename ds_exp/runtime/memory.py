"""Memory as measured: this process's peak, and whether an error was an allocation that failed."""

from __future__ import annotations

import resource

import torch


def peak_memory_bytes(accelerator: str) -> int:
    """This process's peak so far: CUDA's allocator on GPUs, the resident set (RSS) elsewhere."""
    if accelerator == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def is_out_of_memory(exc: BaseException | None) -> bool:
    """A failed allocation anywhere in the exception's chain: CUDA's, the CPU allocator's RuntimeError, MemoryError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True
        if "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False
