"""The dataset contract the runtime relies on, as ``typing.Protocol``s.

A Helix dataset is a map-style torch ``Dataset`` (``__len__``, ``__getitem__``). Each further
capability is optional and has one protocol here; the runtime asks ``isinstance(ds, Costed)``
and so on (``runtime_checkable``: only the methods' presence is checked), never a string:

- ``Costed``: ``estimate_cost(i) -> CostProfile`` without decoding (placement, deadlines, Tier 1),
  optionally ``cost_arrays()`` (every sample at once, from a profile table);
- ``CostFeedback``: ``observe_cost(i, cpu_s)`` folds a measured decode into its cost model;
- ``Epochs``: ``set_epoch(e)``, so random transforms draw from (seed, epoch, index);
- ``Specced``: ``helix_spec() -> {"target", "kwargs"}`` rebuilds it from JSON (no pickle), or
  raises ``SpecError`` naming what JSON cannot carry;
- ``DirectDecode``: ``video_shape(i)`` and ``fetch(i, out=)`` let a worker decode straight into the
  batch's shared-memory slab; ``fetch`` returns ``(sample, measurements)``, whose ``read_bytes`` /
  ``read_s`` (a ``Decoded``'s) tell the DataServer what the sample's storage reads cost;
- ``SamplePaths``: ``sample_path(i)`` names the file in errors.

``VideoClipDataset`` and ``VideoTextDataset`` implement all of them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["CostArrays", "Costed", "CostFeedback", "DirectDecode", "Epochs", "SamplePaths", "Specced"]


@runtime_checkable
class Costed(Protocol):
    def estimate_cost(self, index: int): ...


@runtime_checkable
class CostArrays(Protocol):
    def cost_arrays(self) -> dict | None: ...


@runtime_checkable
class CostFeedback(Protocol):
    def observe_cost(self, index: int, cpu_s: float) -> None: ...


@runtime_checkable
class Epochs(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class Specced(Protocol):
    def helix_spec(self) -> dict: ...


@runtime_checkable
class DirectDecode(Protocol):
    def video_shape(self, index: int) -> tuple[int, int, int, int]: ...

    def fetch(self, index: int, out=None): ...


@runtime_checkable
class SamplePaths(Protocol):
    def sample_path(self, index: int) -> str: ...
