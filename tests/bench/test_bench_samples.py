"""The bench measures whole planning windows, and its sample check rejects a run that loses or
repeats a sample (pure)."""

import pytest

from helix_bench.samples import check_consumed, round_to_windows, window_spans


def test_warmup_and_steps_round_up_to_whole_windows():
    assert round_to_windows(20, 100, steps_per_epoch=6, window=8) == (24, 102)  # a window is an epoch
    assert round_to_windows(20, 100, steps_per_epoch=20, window=8) == (20, 100)  # 8 + 8 + 4 per epoch
    assert round_to_windows(1, 5, steps_per_epoch=20, window=8) == (8, 8)
    assert round_to_windows(0, 3, steps_per_epoch=5, window=1) == (0, 3)
    assert [list(s) for s in window_spans(8, 12, 20, 8)] == [list(range(0, 8)), list(range(8, 12))]
    with pytest.raises(ValueError, match="window boundaries"):
        window_spans(3, 4, 20, 8)


EXPECTED = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # [rank][step]: what the sampler gives
SPANS = [range(0, 2)]


def test_balanced_runs_may_recompose_a_window_but_never_lose_or_repeat():
    moved = [[[0, 7], [2, 5]], [[4, 1], [6, 3]]]
    check_consumed("helix", moved, EXPECTED, SPANS, balanced=True)
    with pytest.raises(RuntimeError, match="consumed samples"):
        check_consumed("native", moved, EXPECTED, SPANS, balanced=False)  # unbalanced: exactly the sampler's
    repeated = [[[0, 7], [2, 5]], [[4, 1], [6, 0]]]
    with pytest.raises(RuntimeError, match=r"lost samples \[3\] and repeated or added \[0\]"):
        check_consumed("helix", repeated, EXPECTED, SPANS, balanced=True)
    short = [[[0, 7, 2], [5]], [[4, 1], [6, 3]]]
    with pytest.raises(RuntimeError, match="rank 0 step 0 consumed 3 samples, its batch size is 2"):
        check_consumed("helix", short, EXPECTED, SPANS, balanced=True)
    across = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(RuntimeError, match="lost samples"):  # a sample moved across a window boundary
        check_consumed("helix", [[[0, 4]], [[1, 5]]], [[[0, 1]], [[4, 6]]], [range(0, 1)], balanced=True)
    check_consumed("native", across, EXPECTED, SPANS, balanced=False)
