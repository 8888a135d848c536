"""Helix for Lightning and Accelerate users (the public ``helix_core`` API only).

``HelixDataModule`` (``trainer.fit(model, datamodule=...)``), ``HelixDeadlineCallback`` (the
trainer's step times become the loader's deadlines) and ``HelixAcceleratePlugin`` (``accelerate
launch`` scripts). Names load on first use, so importing the package costs nothing.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HelixDataModule": "datamodule",
    "HelixDeadlineCallback": "callbacks",
    "HelixAcceleratePlugin": "accelerate",
    "DatasetConfig": "data",
}

__all__ = ["DatasetConfig", "HelixAcceleratePlugin", "HelixDataModule", "HelixDeadlineCallback"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'helix_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
