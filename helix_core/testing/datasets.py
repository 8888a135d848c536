"""Small datasets for tests and benchmarks of the data plane (importable by DataServer workers,
so they travel as import path plus JSON arguments, no pickle)."""

from __future__ import annotations

import os
import time

import torch

__all__ = ["CostedDataset", "IndexDataset", "flip_video", "shift_ranks"]


def flip_video(sample: dict, generator: torch.Generator) -> dict:
    """A module-level ``transform=`` for video datasets: mirror the clip left to right (a JSON spec
    can name it, so it travels to DataServers of a cluster that takes no pickle)."""
    sample["video"] = sample["video"].flip(-1)
    return sample


class IndexDataset(torch.utils.data.Dataset):
    """Sample ``i`` is ``{"x": uint8 tensor of `shape` filled from i, "index": i}``.

    Knobs for fault tests: ``delays`` ({index: seconds}) slows chosen samples; ``fail``
    ({index: message}) raises for them; ``crash`` ({index: "exit"}) kills the worker process
    while it prepares them (``os._exit``).
    """

    def __init__(
        self, n: int, shape=(4,), delays: dict | None = None, fail: dict | None = None, crash: dict | None = None
    ):
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
            from helix_core.errors import SampleError

            raise SampleError(i, self.sample_path(i), self.fail[i])
        if i in self.delays:
            time.sleep(self.delays[i])
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g), "index": i}

    def sample_path(self, i: int) -> str:
        return f"index://{int(i)}"

    def helix_spec(self) -> dict:
        return {
            "target": f"{type(self).__module__}:{type(self).__qualname__}",
            "kwargs": {
                "n": self.n,
                "shape": list(self.shape),
                "delays": {str(k): v for k, v in self.delays.items()},
                "fail": {str(k): v for k, v in self.fail.items()},
                "crash": {str(k): v for k, v in self.crash.items()},
            },
        }


def pair_collate(samples: list[dict]):
    """Collate ``IndexDataset`` samples as ``(x, index)`` pairs, the way tuple-returning datasets
    reach ``default_collate``: the batch is an ``[X, indices]`` pair of columns."""
    from torch.utils.data import default_collate

    return default_collate([(s["x"], s["index"]) for s in samples])


class CostedDataset(IndexDataset):
    """``IndexDataset`` whose samples have known costs without decoding, as a video dataset's
    profile table gives them: ``tokens[i]`` visual tokens and ``cpu_s[i]`` predicted CPU seconds
    (``estimate_cost`` / ``cost_arrays``); ``broken`` lists samples whose cost cannot be estimated
    (``estimate_cost`` raises ``SampleError``, as for a clip that fails to probe)."""

    def __init__(self, n: int, tokens, cpu_s=None, shape=(4,), broken=(), **kwargs):
        super().__init__(n, shape=shape, **kwargs)
        self.tokens = [int(t) for t in tokens]
        self.cpu_s = [float(c) for c in (cpu_s if cpu_s is not None else [t * 1e-5 for t in self.tokens])]
        self.broken = sorted(int(i) for i in broken)
        if len(self.tokens) != self.n or len(self.cpu_s) != self.n:
            raise ValueError(f"CostedDataset: {self.n} samples need {self.n} tokens and cpu_s values")

    def __getitem__(self, i: int) -> dict:
        sample = super().__getitem__(i)
        sample["tokens"] = self.tokens[int(i)]
        return sample

    def estimate_cost(self, i: int):
        from helix_core.data.descriptors import CostProfile
        from helix_core.errors import SampleError

        i = int(i)
        if i in self.broken:
            raise SampleError(i, self.sample_path(i), "cannot be probed")
        return CostProfile(
            cpu_s=self.cpu_s[i], io_bytes=0, out_bytes=4, tokens=self.tokens[i], profile=f"{self.tokens[i]}t"
        )

    def cost_arrays(self) -> dict:
        import numpy as np

        ok = np.ones(self.n, dtype=bool)
        ok[self.broken] = False
        return {
            "tokens": np.asarray(self.tokens, dtype=np.int64),
            "cpu_s": np.asarray(self.cpu_s),
            "bucket": np.array([f"{t}t" for t in self.tokens], dtype=object),
            "ok": ok,
        }

    def helix_spec(self) -> dict:
        spec = super().helix_spec()
        spec["kwargs"].update(tokens=self.tokens, cpu_s=self.cpu_s, broken=self.broken)
        return spec


def shift_ranks(features: list[dict], args: dict) -> list[int]:
    """A Tier-2 ``sort_fn`` for tests: every sample goes to rank ``(rank + shift) % world``
    (a valid assignment: each rank of a step gets one other rank's batch)."""
    return [(f["rank"] + args["shift"]) % args["world"] for f in features]
