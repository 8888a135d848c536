"""The sampler order: the one definition of which samples each rank gets at each step of an epoch.

It is exactly torch's ``DistributedSampler(shuffle, seed, drop_last)`` with ``set_epoch(epoch)``,
cut into batches of ``batch_size`` (the last one short unless ``drop_last``) — what a torch
``DataLoader`` with that sampler yields. The loader (one rank's batches), the Tier-1 planner (every
rank's batches of a window) and the bench (what each emulated rank must receive) all use it.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler

__all__ = ["rank_batches", "rank_indices", "steps"]


class _Len:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def rank_indices(
    num_samples: int, rank: int, world_size: int, shuffle: bool, seed: int, epoch: int, drop_last: bool = False
) -> list[int]:
    """Rank ``rank``'s sample indices of ``epoch``, in order (``DistributedSampler``'s shard)."""
    data = _Len(num_samples)  # a length is all the sampler reads of its dataset
    sampler: DistributedSampler = DistributedSampler(
        data,  # type: ignore[arg-type]
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def rank_batches(
    num_samples: int,
    batch_size: int,
    rank: int,
    world_size: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    drop_last: bool = False,
) -> list[list[int]]:
    """Rank ``rank``'s batches of ``epoch``: its shard cut into ``batch_size`` (``drop_last`` drops
    a short last batch, as passing it to both ``DistributedSampler`` and ``DataLoader`` would)."""
    idx = rank_indices(num_samples, rank, world_size, shuffle, seed, epoch, drop_last)
    batches = [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def steps(
    num_samples: int, batch_size: int, world_size: int, shuffle: bool, seed: int, epoch: int, drop_last: bool = False
) -> list[list[list[int]]]:
    """``steps[s][r]``: rank r's batch at global step s of ``epoch`` (every rank's ``rank_batches``)."""
    per_rank = [
        rank_batches(num_samples, batch_size, r, world_size, shuffle, seed, epoch, drop_last) for r in range(world_size)
    ]
    return [list(step) for step in zip(*per_rank)]
