"""ResumableDistributedSampler: sharding, determinism and mid-epoch resume."""

from __future__ import annotations

import pytest

from ds_exp.train.sampler import ResumableDistributedSampler


def shards(n, world, **kw):
    return [list(ResumableDistributedSampler(n, rank=r, world_size=world, **kw)) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_are_disjoint_and_cover(world):
    parts = shards(103, world, seed=1)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 103 - 103 % world  # drop_last: whole rounds only
    assert all(len(p) == len(ResumableDistributedSampler(103, rank=0, world_size=world, seed=1)) for p in parts)
    padded = shards(103, world, seed=1, drop_last=False)
    assert set().union(*map(set, padded)) == set(range(103)) and len({len(p) for p in padded}) == 1


def test_order_depends_on_seed_and_epoch_only():
    a = ResumableDistributedSampler(50, rank=0, world_size=1, seed=3)
    b = ResumableDistributedSampler(50, rank=0, world_size=1, seed=3)
    assert list(a) == list(b) and list(a) == list(a)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(ResumableDistributedSampler(50, rank=0, world_size=1, seed=4)) != list(b)
    # the global order is the same whatever the world size: rank shards interleave it
    one = list(ResumableDistributedSampler(40, rank=0, world_size=1, seed=3))
    two = shards(40, 2, seed=3)
    assert one[0::2] == two[0] and one[1::2] == two[1]
    assert list(ResumableDistributedSampler(5, rank=0, world_size=1, seed=3, shuffle=False)) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_skip_resumes_exactly():
    full = shards(64, 2, seed=5)
    for rank in range(2):
        s = ResumableDistributedSampler(64, rank=rank, world_size=2, seed=5)
        s.set_epoch(0)
        s.skip(10)  # this rank already consumed 10 samples
        assert list(s) == full[rank][10:] and len(s) == 22
    # set_start counts samples over all ranks, so a resume may change the world size
    one = list(ResumableDistributedSampler(64, rank=0, world_size=1, seed=5))
    s = ResumableDistributedSampler(64, rank=1, world_size=4, seed=5)
    s.set_start(20)
    assert list(s) == one[20:][1::4]
    s.set_epoch(1)  # a new epoch starts from its beginning
    assert len(s) == 16


def test_bad_arguments():
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, rank=2, world_size=2, seed=0)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, rank=0, world_size=1, seed=0).set_start(-1)
