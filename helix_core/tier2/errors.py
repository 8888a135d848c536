"""What can become of a rank's batch in a Tier-2 round, as exceptions the rank acts on."""

from __future__ import annotations

from helix_core.errors import ClusterError
from helix_core.memory.shm import SlabHandle

__all__ = ["RoundLost", "RoundStopped", "RoundUnknown"]


class RoundStopped(ClusterError):
    """The loader stopped while its batch was in a Tier-2 round: ``reply`` is the round's answer
    if it came all the same (its rows are this rank's to give back), else None."""

    def __init__(self, reply):
        super().__init__("loader stopped")
        self.reply = reply


class RoundUnknown(ClusterError):
    """A Tier-2 round's leader cannot say what became of a rank's batch (it died, or its round runs
    past every exchange's limit), and the Coordinator says the round moved samples (``indices``:
    those it gave this rank, to decode again; ``release``: the slab handles its answer had it
    release) or cannot say either (``indices`` None). Other ranks may read its other slabs, so the
    rank neither reads nor releases them."""

    def __init__(self, why: str, indices: list[int] | None = None, release: list[SlabHandle] = ()):
        super().__init__(why)
        self.indices, self.release = indices, list(release)


class RoundLost(Exception):
    """A round's slab vanished (its server died) before this rank read it: ``indices`` are the
    samples of the batch the round gave the rank, in order, to decode again."""

    def __init__(self, indices: list[int], why: str):
        super().__init__(why)
        self.indices = indices
