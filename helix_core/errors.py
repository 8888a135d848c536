"""Exception types of Helix: every error names the thing it is about."""

from __future__ import annotations

import os

__all__ = ["ClusterError", "ManifestError", "SampleError", "SpecError", "text_of"]


def text_of(value) -> str:
    """``value`` as text any wire and table can carry: a file name that is not UTF-8 (POSIX allows
    any bytes; Python holds them as lone surrogates, which protobuf and JSON refuse) keeps its
    bytes visible as ``\\xNN`` escapes instead of breaking the error that names it."""
    text = os.fsdecode(value) if isinstance(value, bytes) else str(value)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class SampleError(Exception):
    """One sample could not be probed, costed or decoded.

    Carries the sample ``index``, its ``path`` and the ``cause`` (text), so one broken clip in a
    million can be found, skipped and reported.
    """

    def __init__(self, index: int, path: str, cause: str):
        self.index = int(index)
        self.path = text_of(path)
        self.cause = text_of(cause)
        super().__init__(f"sample {self.index} ({self.path}): {self.cause}")

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (SampleError, (self.index, self.path, self.cause))


class ManifestError(ValueError):
    """A manifest line is malformed; names the file and the 1-based line number."""

    def __init__(self, manifest: str, line: int, cause: str):
        self.manifest = str(manifest)
        self.line = int(line)
        self.cause = str(cause)
        super().__init__(f"{self.manifest}, line {self.line}: {self.cause}")

    def __reduce__(self):
        return (ManifestError, (self.manifest, self.line, self.cause))


#: Where a dataset, collate function or batch that needs cloudpickle can go (the fix errors name).
PICKLING = (
    "a cluster that accepts cloudpickle (every cluster does over loopback or TLS, unless started "
    "with ClusterConfig(allow_pickle=False))"
)


class ClusterError(RuntimeError):
    """The Helix cluster (Coordinator or DataServers) cannot be reached or failed."""


class SpecError(ValueError):
    """A dataset's ``helix_spec()`` cannot carry one of its arguments as JSON (a ``transform``
    that is not a module-level function, a tokenizer object, a subclass's own fields): it must
    travel by cloudpickle, which an --insecure cluster (or ``allow_pickle=False``) refuses. ``argument`` names it, ``fix`` says what to do."""

    def __init__(self, dataset: str, argument: str, fix: str):
        self.dataset, self.argument, self.fix = str(dataset), str(argument), str(fix)
        super().__init__(f"{self.dataset}: {self.argument} cannot travel as JSON; {self.fix}")

    def __reduce__(self):
        return (SpecError, (self.dataset, self.argument, self.fix))
