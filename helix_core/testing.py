"""Small datasets for tests and benchmarks of the data plane (importable by DataServer workers,
so they travel as import path plus JSON arguments, no pickle)."""
from __future__ import annotations

import os
import time

import torch

__all__ = ["IndexDataset"]


class IndexDataset(torch.utils.data.Dataset):
    """Sample ``i`` is ``{"x": uint8 tensor of `shape` filled from i, "index": i}``.

    Knobs for fault tests: ``delays`` ({index: seconds}) slows chosen samples; ``fail``
    ({index: message}) raises for them; ``crash`` ({index: "exit"}) kills the worker process
    while it prepares them (``os._exit``).
    """

    def __init__(self, n: int, shape=(4,), delays: dict | None = None, fail: dict | None = None,
                 crash: dict | None = None):
        self.n, self.shape = int(n), tuple(shape)
        self.delays = {int(k): float(v) for k, v in (delays or {}).items()}
        self.fail = {int(k): str(v) for k, v in (fail or {}).items()}
        self.crash = {int(k): str(v) for k, v in (crash or {}).items()}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if i in self.crash:
            os._exit(17)
        if i in self.fail:
            from .errors import SampleError

            raise SampleError(i, self.sample_path(i), self.fail[i])
        if i in self.delays:
            time.sleep(self.delays[i])
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g), "index": i}

    def sample_path(self, i: int) -> str:
        return f"index://{int(i)}"

    def helix_spec(self) -> dict:
        return {"target": f"{type(self).__module__}:{type(self).__qualname__}",
                "kwargs": {"n": self.n, "shape": list(self.shape), "delays": {str(k): v for k, v in self.delays.items()},
                           "fail": {str(k): v for k, v in self.fail.items()},
                           "crash": {str(k): v for k, v in self.crash.items()}}}


def pair_collate(samples: list[dict]):
    """Collate ``IndexDataset`` samples as ``(x, index)`` pairs, the way tuple-returning datasets
    reach ``default_collate``: the batch is an ``[X, indices]`` pair of columns."""
    from torch.utils.data import default_collate

    return default_collate([(s["x"], s["index"]) for s in samples])
