"""A DataServer's storage figures: the estimator on synthetic streams (pure), and the worker's
per-sample reads on their way to it."""

import numpy as np
import pytest
import torch

from helix_core.data.media.decode import Decoded
from helix_core.memory.slabpool import SlabPool
from helix_core.server.direct import storage_reads
from helix_core.server.steal import Pieces
from helix_core.server.storagemeter import StorageMeter
from helix_core.server.worker import TaskResult, _run_task

MB = 1e6


def stream(n, latency_s, bandwidth_bps, seed=0, noise=0.1, low=0.05 * MB, high=8 * MB):
    """``n`` samples of random sizes whose waits follow latency + bytes / bandwidth, with
    multiplicative noise."""
    rng = np.random.default_rng(seed)
    sizes = rng.uniform(low, high, n).astype(np.int64)
    waits = (latency_s + sizes / bandwidth_bps) * rng.uniform(1 - noise, 1 + noise, n)
    return list(zip(sizes.tolist(), waits.tolist()))


def test_converges_on_a_synthetic_stream_to_the_latency_and_bandwidth_that_made_it():
    meter = StorageMeter()
    for b, s in stream(400, latency_s=0.03, bandwidth_bps=50 * MB):
        meter.observe(b, s)
    bw, lat = meter.estimate()
    assert bw == pytest.approx(50 * MB, rel=0.15)
    assert lat == pytest.approx(0.03, rel=0.3)
    # a sidecar beside the bucket and one behind a slow link: told apart by an order of magnitude
    near, far = StorageMeter(), StorageMeter()
    for (b1, s1), (b2, s2) in zip(stream(200, 0.005, 500 * MB, seed=1), stream(200, 0.08, 20 * MB, seed=2)):
        near.observe(b1, s1)
        far.observe(b2, s2)
    assert near.estimate()[0] > 10 * far.estimate()[0]
    assert far.predict(4 * MB) > 10 * near.predict(4 * MB)


def test_local_files_and_cache_hits_are_not_observations():
    meter = StorageMeter()
    for _ in range(50):
        meter.observe(0, 0.0)  # a local file
        meter.observe(0, 0.004)  # every block from the local cache: only the stat waited
        meter.observe(1000, 0.0)  # nothing waited (nonsense): ignored too
    assert meter.estimate() == (0.0, 0.0) and meter.samples == 0 and meter.predict(10**6) == 0.0
    for b, s in stream(100, 0.02, 100 * MB):
        meter.observe(b, s)
    before = meter.estimate()
    meter.observe(0, 0.0)
    meter.observe(0, 0.5)
    assert meter.estimate() == before  # zeros between remote samples change nothing


def test_samples_of_one_size_give_their_mean_rate_and_no_latency():
    """Equal sizes cannot separate latency from bandwidth: all bytes over all seconds, which
    predicts the average sample (and a batch of them) exactly."""
    meter = StorageMeter()
    for _ in range(20):
        meter.observe(2_000_000, 0.1)
    bw, lat = meter.estimate()
    assert bw == pytest.approx(20 * MB) and lat == 0.0
    assert meter.predict(2_000_000) == pytest.approx(0.1)
    first = StorageMeter()
    first.observe(1_000_000, 0.5)  # one sample is an estimate already
    assert first.estimate() == (pytest.approx(2 * MB), 0.0)


def test_a_retry_does_not_swing_the_figures_but_a_real_change_gets_through():
    meter = StorageMeter()
    for b, s in stream(100, 0.02, 100 * MB, seed=3, noise=0.02):
        meter.observe(b, s)
    steady = meter.predict(4 * MB)
    meter.observe(4_000_000, 30.0)  # one sample that waited out a retry's backoff
    assert meter.predict(4 * MB) < 1.5 * steady
    for b, s in stream(60, 0.02, 10 * MB, seed=4, noise=0.02):  # the link really got 10x slower
        meter.observe(b, s)
    assert meter.predict(4 * MB) == pytest.approx(0.02 + 4 * MB / (10 * MB), rel=0.2)


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match="alpha"):
        StorageMeter(alpha=0)
    with pytest.raises(ValueError, match="clamp"):
        StorageMeter(clamp=1.0)


class _Clips(torch.utils.data.Dataset):
    """``fetch`` reports reads as ``VideoClipDataset``'s does (a ``Decoded``), without a file."""

    def __len__(self):
        return 4

    def video_shape(self, i):
        return (2, 3, 4, 4)

    def fetch(self, i, out=None):
        video = np.full((2, 3, 4, 4), i, np.uint8) if out is None else out
        video[...] = i
        decoded = Decoded(video, 0.01, 0.01, "sequential", 2, read_bytes=1000 * (i + 1), read_s=0.01 * (i + 1))
        return {"video": torch.from_numpy(video), "index": i}, decoded

    def __getitem__(self, i):
        return self.fetch(i)[0]


def _stack(samples):
    return {"video": torch.stack([s["video"] for s in samples])}


@pytest.mark.parametrize("collate", [torch.utils.data.default_collate, _stack], ids=["in-slab", "generic"])
def test_a_tasks_result_carries_each_samples_reads(collate, tmp_path):
    """Decoded in its slab or collated the generic way, a task's result lists what each sample
    fetched from storage and waited for, in the order of ``decoded``; a split batch's pieces
    keep them in order."""
    task = {"task_id": 1, "spec_id": "s", "indices": [2, 0, 3], "epoch": 0}
    with SlabPool(f"helix-test-reads-{tmp_path.name[-8:]}-") as pool:
        result = _run_task(task, {"s": (_Clips(), collate, None)}, pool, None, False, lambda k: True)
        assert result.decoded == [2, 0, 3]
        assert result.read_bytes == [3000, 1000, 4000]
        assert result.read_s == pytest.approx([0.03, 0.01, 0.04])
        assert result.handle is not None
    pieces = Pieces()
    pieces.add(2)
    a = TaskResult(handle=object(), decoded=[2, 0], read_bytes=[3000, 1000], read_s=[0.03, 0.01])
    b = TaskResult(handle=object(), decoded=[3], read_bytes=[4000], read_s=[0.04])
    pieces.finish(2, b)
    pieces.finish(0, a)
    combined, _ = pieces.combine()
    assert combined.read_bytes == [3000, 1000, 4000] and combined.read_s == [0.03, 0.01, 0.04]


def test_reads_of_a_datasets_own_measurements():
    assert storage_reads(Decoded(np.zeros(1), 0, 0, "seek", 1, 10, 0.5)) == (10, 0.5)
    assert storage_reads(Decoded(np.zeros(1), 0, 0, "seek", 1)) == (0, 0.0)  # a local file
    assert storage_reads(None) == (0, 0.0) and storage_reads({"cpu_s": 1}) == (0, 0.0)
    assert storage_reads(type("M", (), {"read_bytes": "n/a"})()) == (0, 0.0)
