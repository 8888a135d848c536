"""What reading a sample from storage costs this DataServer: its bandwidth and latency, measured
on the samples its workers read by URL, for placement's ``C_io`` (paper Eq. 1).

Split out of the pool, which feeds it, so that the estimator can be tested alone on synthetic
streams: pure arithmetic, no clock (each observation carries its own seconds).
"""

from __future__ import annotations

import math

__all__ = ["StorageMeter"]

_MB = 1e6  # bytes are kept in MB: the weighted sums of squares stay far from float64's limits


class StorageMeter:
    """Storage bandwidth (bytes/s) and latency (seconds per sample) from per-sample reads.

    Model: a sample's wait on storage is ``read_s = latency_s + read_bytes / bandwidth_bps`` —
    a fixed cost per sample (the object's stat, the first byte of each range read) plus its bytes
    at the link's rate. It is fitted by least squares over the samples seen, each weighted
    ``(1 - alpha)^age`` so the figures follow a link that changes (half-weight after about
    ``0.7 / alpha`` samples). A plain EWMA of bytes/s would mistake a high-latency store for a slow
    one whenever samples are small; the fit separates the two.

    Robust where the fit is not: until ``min_samples`` samples, or while their sizes barely differ
    (coefficient of variation below ``min_spread``: the slope is then noise), or if the fit gives a
    slope <= 0 or a negative latency, the estimate is the ratio of the weighted sums — all bytes
    over all seconds, latency 0 — which predicts the average sample exactly. Once estimated, each
    new wait is clamped to within ``clamp`` times the prediction for its size, so one retry's
    backoff cannot swing the figures (a real change still gets through in a few samples).

    Samples that fetched nothing (a local file, whose reads the page cache serves; blocks found in
    the local cache) or waited no time are not observations: a server that reads local files only
    never has an estimate (``estimate`` returns ``(0.0, 0.0)``), and placement keeps its default.
    """

    def __init__(self, alpha: float = 0.1, min_samples: int = 4, min_spread: float = 0.25, clamp: float = 4.0):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"StorageMeter(alpha={alpha!r}): must be in (0, 1]")
        if min_samples < 1 or min_spread < 0 or clamp <= 1.0:
            raise ValueError(
                f"StorageMeter(min_samples={min_samples!r}, min_spread={min_spread!r}, clamp={clamp!r}): "
                "need min_samples >= 1, min_spread >= 0, clamp > 1"
            )
        self.alpha, self.min_samples, self.min_spread, self.clamp = alpha, min_samples, min_spread, clamp
        self.samples = 0  # observations folded in (samples that fetched bytes from storage)
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums of 1, x, y, x², xy
        self._fit = (0.0, 0.0)  # (bandwidth bytes/s, latency s), (0, 0) until the first observation

    def observe(self, read_bytes: int, read_s: float) -> None:
        """Fold one sample's reads in: ``read_bytes`` fetched from storage, ``read_s`` seconds
        waited for them. Zeros (and nonsense) are ignored."""
        if not (read_bytes > 0 and read_s > 0 and math.isfinite(read_s)):
            return
        x, y = read_bytes / _MB, float(read_s)
        if self.samples >= self.min_samples:
            predicted = self.predict(read_bytes)
            y = min(max(y, predicted / self.clamp), predicted * self.clamp)
        keep = 1.0 - self.alpha
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y
        self.samples += 1
        self._fit = self._solve()

    def _solve(self) -> tuple[float, float]:
        w, mx, my = self._w, self._x / self._w, self._y / self._w
        vx = self._xx / w - mx * mx
        if self.samples >= self.min_samples and vx > (self.min_spread * mx) ** 2:
            slope = (self._xy / w - mx * my) / vx  # seconds per MB
            latency = my - slope * mx
            if slope > 0 and latency >= 0:
                return _MB / slope, latency
        return _MB * mx / my, 0.0  # all bytes over all seconds

    def estimate(self) -> tuple[float, float]:
        """``(bandwidth_bps, latency_s)``: bytes per second, seconds per sample; ``(0.0, 0.0)``
        until a sample fetched something from storage."""
        return self._fit

    def predict(self, read_bytes: int) -> float:
        """Seconds one sample of ``read_bytes`` is expected to wait on storage (0 when unmeasured)."""
        bandwidth, latency = self._fit
        return latency + read_bytes / bandwidth if bandwidth > 0 else 0.0
