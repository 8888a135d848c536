"""Which samples a benchmark run measures, and the check that every system consumed them (pure).

Systems that balance by tokens (Tier 1) recompose each window of global steps, so a fair
comparison measures whole windows: warm-up and measured steps are rounded up to window
boundaries (a window starts every ``window`` steps from the start of each epoch, and an epoch's
end closes a window), so no system can win by moving heavy samples into the warm-up or past the
last measured step. Every system then consumes the same multiset of samples over the measured
steps, and the bound and the decode yardstick come from exactly those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

__all__ = ["check_consumed", "is_boundary", "round_to_windows", "window_spans"]


def is_boundary(step: int, steps_per_epoch: int, window: int) -> bool:
    """Whether global step ``step`` starts a planning window."""
    return (step % steps_per_epoch) % window == 0


def _next_boundary(step: int, steps_per_epoch: int, window: int) -> int:
    while not is_boundary(step, steps_per_epoch, window):
        step += 1
    return step


def round_to_windows(warmup: int, steps: int, steps_per_epoch: int, window: int) -> tuple[int, int]:
    """``(warmup, steps)`` rounded up so that both the warm-up and the measured steps are whole
    windows (``steps`` >= the requested number)."""
    if steps_per_epoch < 1 or window < 1 or warmup < 0 or steps < 1:
        raise ValueError(
            f"round_to_windows: steps_per_epoch={steps_per_epoch}, window={window} must be >= 1, "
            f"warmup={warmup} >= 0, steps={steps} >= 1"
        )
    start = _next_boundary(warmup, steps_per_epoch, window)
    end = _next_boundary(start + steps, steps_per_epoch, window)
    return start, end - start


def window_spans(first: int, count: int, steps_per_epoch: int, window: int) -> list[range]:
    """The windows of global steps ``[first, first + count)`` as ranges of positions relative to
    ``first`` (both ends must be window boundaries)."""
    end = first + count
    if not (is_boundary(first, steps_per_epoch, window) and is_boundary(end, steps_per_epoch, window)):
        raise ValueError(f"steps [{first}, {end}) do not start and end on window boundaries")
    spans, start = [], first
    while start < end:
        stop = start + 1
        while stop < end and not is_boundary(stop, steps_per_epoch, window):
            stop += 1
        spans.append(range(start - first, stop - first))
        start = stop
    return spans


def check_consumed(
    system: str,
    consumed: Sequence[Sequence[Sequence[int]]],
    expected: Sequence[Sequence[Sequence[int]]],
    spans: Sequence[range],
    balanced: bool,
) -> None:
    """Raise ``RuntimeError`` naming the system, rank and step unless the run consumed what it must.

    ``consumed[r][s]`` / ``expected[r][s]``: the sample indices rank ``r`` consumed / the sampler
    gives it at measured step ``s``. Unbalanced systems must match exactly; balanced ones must keep
    every rank's batch size, and over each window (``spans``) consume exactly the sampler's
    multiset of samples — so each epoch is consumed exactly once, none lost, none repeated."""
    if len(consumed) != len(expected):
        raise RuntimeError(f"{system}: {len(consumed)} ranks reported, expected {len(expected)}")
    for r, (got, want) in enumerate(zip(consumed, expected)):
        if len(got) != len(want):
            raise RuntimeError(f"{system} rank {r}: {len(got)} measured steps, expected {len(want)}")
        for s, (g, w) in enumerate(zip(got, want)):
            if not balanced and list(g) != list(w):
                raise RuntimeError(f"{system} rank {r} step {s} consumed samples {list(g)}, expected {list(w)}")
            if len(g) != len(w):
                raise RuntimeError(f"{system} rank {r} step {s} consumed {len(g)} samples, its batch size is {len(w)}")
    if not balanced:
        return
    for span in spans:
        got = Counter(i for rank in consumed for s in span for i in rank[s])
        want = Counter(i for rank in expected for s in span for i in rank[s])
        if got != want:
            lost, extra = sorted((want - got).elements()), sorted((got - want).elements())
            raise RuntimeError(
                f"{system}: window of measured steps {span.start}..{span.stop - 1} lost samples "
                f"{lost} and repeated or added {extra}"
            )
