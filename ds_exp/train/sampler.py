"""A distributed sampler whose order is a function of (seed, epoch) only, and that can resume mid-epoch."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def _mix(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch); unlike seed + epoch, (3, 1) and (4, 0) differ."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


class ResumableDistributedSampler(Sampler[int]):
    """Rank r yields positions r, r+W, ... of a permutation of (seed, epoch); resumable (`set_start`, `skip`)."""

    def __init__(
        self,
        num_samples: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = 0

    def set_start(self, consumed: int) -> None:
        """Skip the first `consumed` samples of the current epoch (counted over all ranks)."""
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        self.start = consumed

    def skip(self, n: int) -> None:
        """Skip the first n samples this rank already yielded in the current epoch."""
        self.set_start(n * self.world_size)

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_mix(self.seed, self.epoch))  # seed and epoch only: rank and world size play no part
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        rest = order[self.start :]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.world_size]
        if rest and len(rest) % self.world_size:
            pad = self.world_size - len(rest) % self.world_size
            rest += (rest * (pad // len(rest) + 1))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.rank :: self.world_size])

    def __len__(self) -> int:
        rest = max(0, self.num_samples - self.start)
        if self.drop_last:
            return rest // self.world_size
        return -(-rest // self.world_size)
