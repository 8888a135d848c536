"""Tier-1 batch planner (paper Algorithm 1, Tier 1; Section 3.4): pure, no gRPC, processes or clocks.

Before anything is decoded, the planner takes the next ``window`` global steps of the epoch's
sampler order and recomposes exactly those samples into ``window`` steps x ``world_size`` ranks,
each rank keeping its batch size, so that the sum over steps of the slowest rank's predicted GPU
cost is small. One step alone leaves little freedom (a large clip costs tens of times a small one
for VideoMAE); a window of a few steps can group similar clips into one step and make its ranks
nearly equal, while the window still holds exactly the sampler's mixture (no token-sorted prefix).

Algorithm (deterministic; ties go to the lower position in the input, never to hash order):

1. Start "chunks": sort the window's samples by cost, descending, cut the order into steps of
   the given sizes (the largest steps first, so a short last step of an epoch gets the cheapest
   samples), and inside each step run cardinality-constrained LPT (largest sample first to the
   least-loaded rank that still has room).
   Start "bins": the same LPT over all ``window x world_size`` rank batches at once, then the
   steps take the batches in order of load, ``world_size`` at a time (for fixed batches, grouping
   sorted loads is what minimises the sum of step maxima).
2. Within each step: swap samples between the most-loaded rank and another while that lowers
   the pair's maximum.
3. Between steps: swap a sample of a step's most-loaded rank for a cheaper one of another step
   whenever that lowers the sum of the two steps' maxima, then repeat 2 on both steps.
4. Keep the better start (the second only runs when the first is over 1% from perfect balance).
   "chunks" wins by far when a few clips dwarf the rest; "bins" reached the optimum (checked
   exhaustively) on the few-profile mixtures of the bench with 2 samples per rank. If the
   sampler's own composition is as good, it is kept as it is (nothing moves).
5. Order the window's steps heavy, light, 2nd heavy, 2nd light, ...: decode CPU cost grows with
   tokens, so sorted steps would ask the CPU pool for a burst of heavy decodes and then leave it
   idle; alternating keeps the decode demand per step near the window's mean, which prefetching a
   few steps ahead can absorb.

Costs are quantized to integers (relative to the window's largest) before planning, so that every
sum is exact and ranks on different machines (other numpy builds, other SIMD paths) compute
bit-identical plans from the same inputs without talking to each other.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Costs", "Plan", "TokenPlanner"]

#: ``plan[step][rank]`` -> sample indices (the rank's batch at that step)
Plan = list[list[list[int]]]

Costs = Sequence[float] | np.ndarray | Callable[[int], float]


@dataclass(frozen=True)
class TokenPlanner:
    """Recompose windows of global steps so every step's ranks carry nearly equal GPU cost.

    ``world_size``: ranks; ``window``: global steps planned together (counted from the start of
    each epoch; ``window=1`` is the paper's within-step, zero-migration mode).
    """

    world_size: int
    window: int = 8

    def __post_init__(self):
        for name in ("world_size", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"TokenPlanner({name}={v!r}): {name} must be an int >= 1")

    def windows(self, num_steps: int) -> list[range]:
        """The epoch's windows as step ranges: ``[0, W), [W, 2W), ...``; the last may be shorter."""
        if num_steps < 0:
            raise ValueError(f"num_steps={num_steps}: must be >= 0")
        return [range(s, min(s + self.window, num_steps)) for s in range(0, num_steps, self.window)]

    def plan_window(self, steps: Sequence[Sequence[Sequence[int]]], costs: Costs) -> Plan:
        """The window's plan: ``steps[s][r]`` are the sampler's indices for rank ``r`` at step ``s``;
        ``costs[i]`` (or ``costs(i)``) is sample ``i``'s predicted GPU cost (units >= 0; fill unknown
        ones first with ``fill_unknown_costs``). The result has the same shape (per-step per-rank
        lengths) and the same multiset of indices (padding duplicates included)."""
        sizes, idx = _check_steps(steps, self.world_size, self.window)
        if not len(idx):
            return [[[] for _ in range(self.world_size)] for _ in sizes]
        q = _quantized(idx, costs)
        if self.world_size == 1:  # one rank: nothing to balance, keep the sampler's order
            return [[list(map(int, st[0]))] for st in steps]
        # the better of two starts (ties: the first); the second is skipped within 1% of perfect
        best: _Window | None = None
        for start in ("chunks", "bins"):
            state = _Window(q, sizes, self.world_size, start)
            state.improve()
            if best is None or state.objective() < best.objective():
                best = state
            if len(state.sizes) == 1 or best.objective() * self.world_size * 100 <= int(q.sum()) * 101:
                break  # one step: both starts are the same LPT
        assert best is not None  # the loop ran at least once
        if _objective(q, sizes, self.world_size) <= best.objective():  # never worse than the sampler
            return [[list(map(int, batch)) for batch in step] for step in steps]
        return best.plan(idx, sizes)


class _Window:
    """Working state of one window as slots: planned step (group) g, rank r, place j is one slot,
    and a group's slots are contiguous, rank by rank, so ``val[g's slots].reshape(R, n)`` is the
    step's cost matrix. Planning moves (cost, position) pairs between slots."""

    def __init__(self, q: np.ndarray, sizes: list[int], ranks: int, start: str):
        self.R, self.q = ranks, q
        self.sizes = sorted((n for n in sizes if n), reverse=True)  # largest first: cheap samples end short
        self.offsets = np.concatenate([[0], np.cumsum([ranks * n for n in self.sizes])]).astype(np.int64)
        self.grp = np.repeat(np.arange(len(self.sizes)), [ranks * n for n in self.sizes])
        self.rnk = np.concatenate([np.repeat(np.arange(ranks), n) for n in self.sizes] or [np.zeros(0, np.int64)])
        self.rank_starts = np.concatenate(
            [o + n * np.arange(ranks) for o, n in zip(self.offsets, self.sizes)] or [np.zeros(0, np.int64)]
        )
        # moves must gain 0.1% of a mean batch: finer gains are noise in the estimates, and cost time
        self.tol = max(1, int(q.sum()) // max(1, ranks * len(self.sizes) * 1000))
        order = np.lexsort((np.arange(len(q)), -q)).tolist()  # cost descending, ties by position
        ql, layout = q.tolist(), []  # layout: the rank batches in slot order
        if start == "chunks":  # consecutive runs of the sorted order, balanced step by step
            for g, n in enumerate(self.sizes):
                layout += _lpt(order[self.offsets[g] : self.offsets[g + 1]], [n] * ranks, ql)[0]
        else:  # "bins": balance all rank batches of the window at once, then group similar ones
            caps = [n for n in self.sizes for _ in range(ranks)]
            bins, load = _lpt(order, caps, ql)
            by_size = {
                n: sorted((i for i, c in enumerate(caps) if c == n), key=lambda i: (-load[i], i))
                for n in set(self.sizes)
            }
            for n in self.sizes:  # each step of size n takes the next R heaviest batches of size n
                layout += [bins[i] for i in by_size[n][:ranks]]
                del by_size[n][:ranks]
        self.pos = np.fromiter((p for b in layout for p in b), np.int64, len(q))
        self.val = q[self.pos]
        for g in range(len(self.sizes)):
            self._refine(g)

    def _swap(self, a: int, b: int) -> None:
        val, pos = self.val, self.pos
        val[a], val[b], pos[a], pos[b] = val[b], val[a], pos[b], pos[a]

    def _refine(self, g: int) -> None:
        """Within step ``g``: swap between the most-loaded rank and another while the pair's max drops."""
        lo, n = int(self.offsets[g]), self.sizes[g]
        q = self.val[lo : lo + self.R * n].reshape(self.R, n)  # a view: swaps show through
        for _ in range(4 * self.R * n):  # each swap strictly lowers the sorted loads: a cap, not a limit
            loads = q.sum(axis=1)
            m = int(np.argmax(loads))
            top = loads[m]
            d = q[m][:, None, None] - q[None, :, :]  # [x in rank m, rank, y]
            # the pair's new max; >= top for d <= 0 and for rank m itself, so those never win
            new = np.maximum(top - d, loads[None, :, None] + d)
            k = int(np.argmin(new))
            if new.flat[k] >= top - self.tol:
                return
            x, rest = divmod(k, self.R * n)
            self._swap(lo + m * n + x, lo + rest)

    def objective(self) -> int:
        """Sum over steps of the most-loaded rank's cost (quantized units)."""
        return int(self.loads().max(axis=1).sum())

    def loads(self) -> np.ndarray:
        """``[group, rank]`` -> summed cost (exact integers)."""
        return np.add.reduceat(self.val, self.rank_starts).reshape(len(self.sizes), self.R)

    def _cross_move(self) -> bool:
        """The best swap between steps, if it lowers the sum of the two steps' maxima by more than
        ``tol``: a sample of a step's most-loaded rank for a cheaper one of another step (ties:
        lower slots). False when no swap helps."""
        loads, grp, rnk, val = self.loads(), self.grp, self.rnk, self.val
        top, arg = loads.max(axis=1), loads.argmax(axis=1)
        second = np.sort(loads, axis=1)[:, -2]
        # a step's max can drop at most to its second rank's load: sources need that headroom
        at_top = (rnk == arg[grp]) & (top - second > self.tol)[grp]
        xs = np.flatnonzero(at_top)
        if not len(xs):
            return False
        # if slot y's rank gains d, its step max changes by max(rest_y, gap_y + d): rest_y is the
        # step's max without y's rank minus its max (<= 0), gap_y y's rank load minus it (<= 0)
        rest = np.where(rnk == arg[grp], second[grp], top[grp]) - top[grp]
        gap = loads[grp, rnk] - top[grp]
        d = val[xs][:, None] - val[None, :]
        gx = grp[xs][:, None]
        # both steps' changes; >= 0 whenever d <= 0, so only cheaper samples can win
        delta = np.maximum(-d, (second - top)[gx]) + np.maximum(rest[None, :], gap[None, :] + d)
        delta[gx == grp[None, :]] = 0  # not within a step (that is _refine)
        k = int(np.argmin(delta))
        if delta.flat[k] >= -self.tol:
            return False
        a, b = int(xs[k // len(val)]), k % len(val)
        self._swap(a, b)
        self._refine(int(grp[a]))
        self._refine(int(grp[b]))
        return True

    def improve(self) -> None:
        """Swaps between steps until none lowers the sum of step maxima (bounded: each gains > tol)."""
        if len(self.sizes) < 2:
            return
        for _ in range(4 * len(self.sizes) * self.R):
            if not self._cross_move():
                return

    def plan(self, idx: np.ndarray, sizes: list[int]) -> Plan:
        """Map the planned steps onto the window's steps of the same per-rank length, alternating
        heavy and light steps; each rank's batch lists its samples in input order."""
        totals = self.loads().sum(axis=1)
        out: Plan = [[[] for _ in range(self.R)] if n == 0 else None for n in sizes]  # type: ignore[misc]
        for n in sorted(set(sizes) - {0}, reverse=True):
            slots = [s for s, size in enumerate(sizes) if size == n]
            groups = sorted((g for g, size in enumerate(self.sizes) if size == n), key=lambda g: (-totals[g], g))
            alternating = [groups[i // 2] if i % 2 == 0 else groups[-1 - i // 2] for i in range(len(groups))]
            for s, g in zip(slots, alternating):
                lo = int(self.offsets[g])
                out[s] = [idx[np.sort(self.pos[lo + r * n : lo + (r + 1) * n])].tolist() for r in range(self.R)]
        return out


def _objective(q: np.ndarray, sizes: list[int], ranks: int) -> int:
    """Sum over steps of the most-loaded rank's cost for costs ``q`` laid out step by step, rank by rank."""
    total, lo = 0, 0
    for n in sizes:
        if n:
            total += int(q[lo : lo + ranks * n].reshape(ranks, n).sum(axis=1).max())
        lo += ranks * n
    return total


def _lpt(items: list[int], caps: list[int], q: list[int]) -> tuple[list[list[int]], list[int]]:
    """Cardinality-constrained LPT: ``items`` (largest first) each to the least-loaded bin that
    still has room (ties: lower bin); bin ``i`` takes exactly ``caps[i]`` items. Returns the bins
    and their loads."""
    bins: list[list[int]] = [[] for _ in caps]
    loads = [0] * len(caps)
    heap = [(0, i) for i, c in enumerate(caps) if c]
    for p in items:
        load, i = heapq.heappop(heap)
        bins[i].append(p)
        loads[i] = load + q[p]
        if len(bins[i]) < caps[i]:
            heapq.heappush(heap, (loads[i], i))
    return bins, loads


def _check_steps(steps, world_size: int, window: int) -> tuple[list[int], np.ndarray]:
    """Per-step per-rank lengths and the window's indices, flattened step by step, rank by rank."""
    if len(steps) > window:
        raise ValueError(f"steps: {len(steps)} steps exceed window={window}")
    sizes: list[int] = []
    flat: list[int] = []
    for s, step in enumerate(steps):
        if len(step) != world_size:
            raise ValueError(f"steps[{s}] has {len(step)} ranks, world_size={world_size}")
        lens = {len(batch) for batch in step}
        if len(lens) != 1:
            raise ValueError(f"steps[{s}]: ranks have different lengths {[len(b) for b in step]}")
        sizes.append(lens.pop())
        for batch in step:
            flat.extend(int(i) for i in batch)
    idx = np.asarray(flat, dtype=np.int64)
    if len(idx) and idx.min() < 0:
        raise ValueError(f"steps: negative sample index {int(idx.min())}")
    return sizes, idx


def _quantized(idx: np.ndarray, costs: Costs) -> np.ndarray:
    """The window's costs as int64 on a scale of 2**k per largest cost (exact, order-free sums)."""
    if callable(costs):
        c = np.asarray([float(costs(int(i))) for i in idx], dtype=np.float64)
    else:
        arr = np.asarray(costs, dtype=np.float64)
        if len(idx) and idx.max() >= len(arr):
            raise ValueError(f"steps: sample index {int(idx.max())} but costs has {len(arr)} entries")
        c = arr[idx]
    bad = ~np.isfinite(c) | (c < 0)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"costs[{int(idx[j])}]={c[j]}: costs must be finite and >= 0 (fill unknown costs with fill_unknown_costs)"
        )
    top = float(c.max()) if len(c) else 0.0
    if top <= 0.0:
        return np.zeros(len(c), np.int64)
    bits = min(40, 62 - int(len(c)).bit_length())  # sums of every sample stay below 2**62
    return np.rint(c / top * float(2**bits)).astype(np.int64)
