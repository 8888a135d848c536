"""The manifest: JSON lines, one sample each; ``path`` required (absolute or relative to the
manifest's folder), ``caption`` / ``label`` optional, unknown keys kept and passed through."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helix_core.errors import ManifestError

__all__ = ["Manifest"]


class Manifest:
    """Parsed manifest: ``records[i]`` is the i-th line's dict, ``paths[i]`` its resolved path."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).absolute()  # clip paths are the same from any working directory
        self.root = self.path.parent
        self.records: list[dict] = []
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise FileNotFoundError(f"manifest {self.path}: {e.strerror or e}") from None
        with f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                self.records.append(self._parse(raw, lineno))
        if not self.records:
            raise ManifestError(str(self.path), 1, "manifest has no samples")
        self.paths = [self.resolve(r["path"]) for r in self.records]

    def _parse(self, raw: bytes, lineno: int) -> dict:
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(str(self.path), lineno, f"not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ManifestError(str(self.path), lineno, f"expected a JSON object, got {type(rec).__name__}")
        path = rec.get("path")
        if not isinstance(path, str) or not path:
            raise ManifestError(str(self.path), lineno, "missing required field 'path' (a non-empty string)")
        if "caption" in rec and not isinstance(rec["caption"], str):
            raise ManifestError(str(self.path), lineno, "field 'caption' must be a string")
        if "label" in rec and not isinstance(rec["label"], int):
            raise ManifestError(str(self.path), lineno, "field 'label' must be an integer")
        return rec

    def resolve(self, path: str) -> str:
        return path if os.path.isabs(path) else str(self.root / path)

    def __len__(self) -> int:
        return len(self.records)

    def hint(self, key: str) -> list[float]:
        """Per-sample numeric hint ``key`` (NaN where absent), e.g. ``num_frames`` / ``size``."""
        out = []
        for r in self.records:
            v = r.get(key)
            out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan"))
        return out
