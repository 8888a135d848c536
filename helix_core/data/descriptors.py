"""Pure data that Helix schedules before any tensor exists (paper §3.2, §4.5)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["CostProfile", "FRAME_SOURCES", "SampleDescriptor"]

#: How ``SampleDescriptor.frames`` was obtained: read from the container header, estimated as
#: duration x fps, or counted from demuxed packets (no decode).
FRAME_SOURCES = ("header", "duration_x_fps", "packet_count")


@dataclass(frozen=True)
class SampleDescriptor:
    """Container facts of one sample, read from metadata alone (no full decode).

    Units: ``bytes`` in bytes, ``duration_s`` in seconds, ``fps`` in frames per second,
    ``width`` / ``height`` in pixels of the coded picture.
    ``frames_source`` / ``duration_source`` say whether a value came from the header or was
    estimated (see ``FRAME_SOURCES``; a duration is ``"header"`` or ``"frames_div_fps"``).
    """

    index: int
    path: str
    bytes: int
    duration_s: float
    fps: float
    frames: int
    width: int
    height: int
    codec: str
    caption_len: int = 0
    locality: str = "local"
    frames_source: str = "header"
    duration_source: str = "header"

    def __post_init__(self):
        if self.frames_source not in FRAME_SOURCES:
            raise ValueError(f"frames_source={self.frames_source!r}; valid: {FRAME_SOURCES}")
        if self.frames < 0 or self.width < 0 or self.height < 0:
            raise ValueError(f"negative size in descriptor of sample {self.index}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SampleDescriptor:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class CostProfile:
    """Predicted cost of preparing one sample for one model configuration.

    ``cpu_s``: CPU seconds to fetch, decode and resize it on one core; ``io_bytes``: encoded input
    bytes read; ``out_bytes``: bytes of the decoded uint8 tensor; ``tokens``: visual tokens the
    model will see (GPU cost); ``profile``: its decode profile ``"TxHxW"`` (frames x resolution),
    the bucket the Tier-1 planner groups by.
    """

    cpu_s: float
    io_bytes: int
    out_bytes: int
    tokens: int
    profile: str
