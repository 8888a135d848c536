"""Cost profiles (paper §4.5): the offline JSONL ``ProfileTable`` and the online ``CostModel``.

CPU cost model (seconds on one core, single-threaded decoder)::

    cpu_s = cost_scale[row] * correction[bucket] * (intercept_s + s_per_decoded_px * decoded_px
                                                    + s_per_output_px * output_px)

``decoded_px`` = frames the codec decodes x source pixels; ``output_px`` = sampled frames x swscale
output pixels. The three coefficients come from a short calibration (a few clips decoded per
bucket, least squares); ``cost_scale`` is the calibration's per-bucket residual; ``correction`` is
refined online from measured decode times (``CostModel.update``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from helix_core.data.descriptors import SampleDescriptor

__all__ = ["CostFit", "CostModel", "calibrate", "profile_bucket"]


@dataclass(frozen=True)
class CostFit:
    """Coefficients of the CPU-cost model: seconds, seconds per decoded source pixel, seconds per
    output pixel. Defaults are this project's 2-core reference machine, for uncalibrated use."""

    intercept_s: float = 15e-3
    s_per_decoded_px: float = 1.2e-9
    s_per_output_px: float = 3.5e-9
    points: int = 0  # calibration decodes the fit came from (0: defaults)

    def __post_init__(self):
        for k in ("intercept_s", "s_per_decoded_px", "s_per_output_px"):
            v = getattr(self, k)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"CostFit.{k} must be a finite number >= 0, got {v}")

    def predict(self, decoded_px, output_px):
        """Seconds for arrays (or scalars) of decoded and output pixels."""
        return (
            self.intercept_s
            + self.s_per_decoded_px * np.asarray(decoded_px, dtype=np.float64)
            + self.s_per_output_px * np.asarray(output_px, dtype=np.float64)
        )


def profile_bucket(frames, width, height):
    """Profile bucket of source clips, ``"<frames>f@<short side>p"``: frames rounded to a power
    of two, the short side to a multiple of 16 (vectorised: a str for scalars, else an object
    array whose equal buckets share one str)."""
    f = np.maximum(np.asarray(frames, dtype=np.float64), 1)
    fb = np.exp2(np.round(np.log2(f))).astype(np.int64)
    short = (np.round(np.minimum(np.asarray(width), np.asarray(height)) / 16.0) * 16).astype(np.int64)
    if fb.ndim == 0 and short.ndim == 0:
        return f"{fb}f@{short}p"
    fb, short = np.broadcast_arrays(fb, short)
    # a few distinct buckets among many rows: format each once (a million str conversions take seconds)
    keys, inverse = np.unique((fb.ravel() << 32) | (short.ravel() & 0xFFFFFFFF), return_inverse=True)
    names = np.array([f"{k >> 32}f@{k & 0xFFFFFFFF}p" for k in keys.tolist()] or [""], dtype=object)
    return names[inverse.reshape(fb.shape)]


@dataclass
class CostModel:
    """Online CPU-cost model: ``fit`` plus a per-bucket correction learnt from measurements.

    ``work_fn(descriptor) -> (decoded_px, output_px)`` is the dataset's geometry for the sample, so
    ``update(descriptor, measured_seconds)`` needs nothing else. Corrections move by an
    exponentially weighted mean of measured / predicted (``alpha``), clamped to [0.05, 20].
    """

    fit: CostFit = field(default_factory=CostFit)
    work_fn: Callable[[SampleDescriptor], tuple[float, float]] | None = None
    alpha: float = 0.2
    corrections: dict[str, float] = field(default_factory=dict)
    updates: int = 0

    def __post_init__(self):
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def _base(self, descriptor: SampleDescriptor) -> float:
        if self.work_fn is None:
            raise ValueError("CostModel needs work_fn to cost a descriptor")
        decoded_px, output_px = self.work_fn(descriptor)
        return float(self.fit.predict(decoded_px, output_px))

    def correction(self, bucket: str) -> float:
        return self.corrections.get(bucket, 1.0)

    def predict(self, descriptor: SampleDescriptor, scale: float = 1.0) -> float:
        """Predicted CPU seconds of ``descriptor``."""
        bucket = profile_bucket(descriptor.frames, descriptor.width, descriptor.height)
        return self._base(descriptor) * scale * self.correction(bucket)

    def update(self, descriptor: SampleDescriptor, measured_seconds: float, scale: float = 1.0) -> float:
        """Fold one measured decode (CPU seconds) into the bucket's correction; returns it."""
        bucket = profile_bucket(descriptor.frames, descriptor.width, descriptor.height)
        return self.update_bucket(bucket, self._base(descriptor) * scale, measured_seconds)

    def update_bucket(self, bucket: str, predicted_s: float, measured_seconds: float) -> float:
        """``update`` for a sample known by its ``bucket`` and its offline prediction (seconds,
        without the correction), e.g. from a dataset's cost arrays; returns the new correction."""
        if not (math.isfinite(measured_seconds) and measured_seconds >= 0):
            raise ValueError(f"measured_seconds must be finite and >= 0, got {measured_seconds}")
        base = max(float(predicted_s), 1e-9)
        old = self.correction(bucket)
        new = (1 - self.alpha) * old + self.alpha * (measured_seconds / base)
        self.corrections[bucket] = float(min(max(new, 0.05), 20.0))
        self.updates += 1
        return self.corrections[bucket]

    def state_dict(self) -> dict:
        return {"fit": asdict(self.fit), "corrections": dict(self.corrections), "updates": self.updates}


def _calibration_configs(d: SampleDescriptor):
    """Two sequential decodes per clip that differ mostly in output work, so the fit can tell
    codec cost from swscale cost: 4 frames at a 64p short side, and up to 64 frames at source
    resolution (``(indices, resize_hw)`` pairs)."""
    from helix_core.data.media.decode import uniform_indices

    short = max(min(d.width, d.height), 1)
    s = min(64, short)
    small = (max(2, round(d.height * s / short) // 2 * 2), max(2, round(d.width * s / short) // 2 * 2))
    return [(uniform_indices(d.frames, 4), small), (uniform_indices(d.frames, min(64, d.frames)), (d.height, d.width))]


def calibrate(descriptors: list[SampleDescriptor], per_bucket: int = 2, progress=None, storage=None):
    """Decode ``per_bucket`` clips of every profile bucket and fit ``CostFit`` by least squares.

    Returns ``(fit, bucket_scale, points)``: ``bucket_scale`` maps a bucket to its median measured /
    fitted ratio; ``points`` lists every measurement (for the table's header). Clips that fail to
    decode (or to be fetched) are left out. ``progress`` is called once per decode. ``storage``:
    how clips at URLs are read (a ``Storage``); such a clip is fetched once into memory and its
    decodes read it there, so they measure the codec's CPU, not the network.
    """
    from helix_core.data.media.decode import decode_frames
    from helix_core.data.storage.reader import StorageError
    from helix_core.errors import SampleError

    chosen: dict[str, list[SampleDescriptor]] = {}
    for d in descriptors:
        group = chosen.setdefault(profile_bucket(d.frames, d.width, d.height), [])
        if len(group) < per_bucket:
            group.append(d)
    points: list[dict] = []
    if not any(chosen.values()):
        return CostFit(), {}, points
    for d in descriptors[:1]:  # warm-up: the first decode in a process pays one-time codec setup
        try:
            decode_frames(d.path, [0], (16, 16), index=d.index, exact_count=False, storage=storage)
        except SampleError:
            pass
    for bucket, group in sorted(chosen.items()):
        for d in group:
            configs = _calibration_configs(d)
            try:
                data = _fetched(d, storage)
            except StorageError:  # skipped, as a clip that fails to decode
                for _ in configs:
                    if progress is not None:
                        progress()
                continue
            for idx, hw in configs:
                try:
                    r = decode_frames(
                        d.path, idx, hw, index=d.index, exact_count=False, strategy="sequential", data=data
                    )
                except SampleError:
                    continue
                finally:
                    if progress is not None:
                        progress()
                points.append(
                    {
                        "bucket": bucket,
                        "index": d.index,
                        "cpu_s": r.cpu_s,
                        "decoded_px": r.frames_decoded * d.width * d.height,
                        "output_px": len(idx) * hw[0] * hw[1],
                    }
                )
    if len(points) < 3:
        return CostFit(), {}, points
    fit = _least_squares(points)
    ratios: dict[str, list[float]] = {}
    for p in points:
        ratios.setdefault(p["bucket"], []).append(
            p["cpu_s"] / max(float(fit.predict(p["decoded_px"], p["output_px"])), 1e-9)
        )
    return fit, {b: float(np.median(r)) for b, r in ratios.items()}, points


def _fetched(d: SampleDescriptor, storage) -> bytes | None:
    """A clip at a URL as its bytes (one read; ``StorageError`` when it cannot be fetched), None
    for a local file (decoded from its path)."""
    from helix_core.data.storage.config import Storage
    from helix_core.data.storage.reader import read_range
    from helix_core.data.storage.urls import is_url

    if not is_url(d.path):
        return None
    storage = storage or Storage.of()
    return read_range(d.path, 0, d.bytes, storage.options, storage.remote)


def _least_squares(points) -> CostFit:
    """Non-negative least squares over [1, decoded_px, output_px] by dropping negative terms."""
    y = np.array([p["cpu_s"] for p in points])
    cols = np.array([[1.0, p["decoded_px"], p["output_px"]] for p in points])
    norm = np.maximum(cols.max(axis=0), 1e-12)
    active = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(cols[:, active] / norm[active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[active] = np.maximum(coef, 0) / norm[active]
    return CostFit(
        intercept_s=float(full[0]), s_per_decoded_px=float(full[1]), s_per_output_px=float(full[2]), points=len(points)
    )
