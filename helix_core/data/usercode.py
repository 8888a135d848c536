"""How user code reaches the DataServers: by reference where a server can import it, else by value.

torch's spawned workers get the parent's ``sys.path`` (and a forked one its memory), so a
transform imported from a module beside the training script just works there. A DataServer is
another program, possibly on another host: it can import what is *installed* — the standard
library, site-packages, an editable install, a ``PYTHONPATH`` folder — but not the script's folder,
the working directory, or whatever the script added to ``sys.path``. So a function or class of
such a module (or of ``__main__``, or of a module the user registered with
``cloudpickle.register_pickle_by_value``) travels by value: cloudpickle carries its code, which
needs a cluster that takes pickles. ``installed`` decides; ``dumps`` pickles with every local module
by value; ``why_local`` says, for an error message, why a name cannot be sent by reference.

DataServers that the loader starts itself also get the client's ``sys.path`` and working
directory (``server_environ``), as torch's workers do.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import threading
from contextlib import contextmanager

__all__ = ["dumps", "installed", "local_modules", "server_environ", "why_local"]

_DUMPS = threading.RLock()


@functools.lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    """Folders whose modules every process of this interpreter imports: the standard library,
    site-packages (system, venv, user) and ``PYTHONPATH`` (what a server started the same way has too)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.update(p for k in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(k)))
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    roots.update(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    return tuple(sorted({os.path.realpath(r) for r in roots if r}))


@functools.lru_cache(maxsize=1)
def _distribution_packages() -> frozenset[str]:
    """Top-level names of installed distributions (editable installs included, whose files lie
    outside site-packages)."""
    from importlib.metadata import packages_distributions

    try:
        return frozenset(packages_distributions())
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: fall back to the file test
        return frozenset()


def _by_value_registered(name: str) -> bool:
    import cloudpickle

    registered = getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", set())
    parts = name.split(".")
    return any(".".join(parts[:i]) in registered for i in range(1, len(parts) + 1))


def _files(module) -> list[str]:
    file = getattr(module, "__file__", None)
    if file:
        return [file]
    return list(getattr(module, "__path__", None) or ())  # a namespace package: its folders


@functools.lru_cache(maxsize=4096)
def _installed_file(path: str) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in _installed_roots())


def installed(name: str) -> bool:
    """Whether a server of this interpreter imports module ``name`` as this process does: not
    ``__main__``, not registered by value, and built in, or in an installed folder or distribution."""
    if name == "__main__" or name.split(".")[0] == "__mp_main__" or _by_value_registered(name):
        return False
    module = sys.modules.get(name)
    if module is None:
        return True  # never imported here: nothing of it can be in what we send
    if name.split(".")[0] in sys.builtin_module_names or name.split(".")[0] in sys.stdlib_module_names:
        return True
    files = _files(module)
    if not files:
        return True  # built in or frozen
    if all(_installed_file(f) for f in files):
        return True
    return name.split(".")[0] in _distribution_packages()


def why_local(obj) -> str | None:
    """Why ``obj`` (a function or class) cannot be sent by import path, or None if it can."""
    name = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", "")
    if not name:
        return "it has no module"
    if "<lambda>" in qual:
        return "a lambda"
    if "<locals>" in qual:
        return "defined inside a function"
    if name in ("__main__", "__mp_main__"):
        return "defined in the script itself (__main__)"
    if _by_value_registered(name):
        return f"its module {name} is registered with cloudpickle.register_pickle_by_value"
    if not installed(name):
        where = _files(sys.modules[name])[0]
        return f"its module {name} ({where}) is not installed where the DataServers run"
    return None


def local_modules() -> list[str]:
    """Modules imported here that a DataServer might not import (``installed`` is False)."""
    return sorted(n for n, m in list(sys.modules.items()) if m is not None and not installed(n))


@contextmanager
def _by_value(names: list[str]):
    import cloudpickle

    added = []
    try:
        for n in names:
            if n in sys.modules and n not in ("__main__", "__mp_main__") and not _by_value_registered(n):
                cloudpickle.register_pickle_by_value(sys.modules[n])
                added.append(n)
        yield
    finally:
        for n in added:
            try:
                cloudpickle.unregister_pickle_by_value(sys.modules[n])
            except (ValueError, KeyError):
                pass


def dumps(obj) -> bytes:
    """cloudpickle ``obj`` with the code of every local module (``local_modules``) by value, so that
    a server rebuilds it without importing the script's folder."""
    import cloudpickle

    with _DUMPS, _by_value(local_modules()):  # cloudpickle's registry is the process's: one dumps at a time
        return cloudpickle.dumps(obj)


def server_environ(env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) for a server the loader starts on this machine: the
    client's ``sys.path`` ahead of its ``PYTHONPATH``, as torch gives its spawned workers."""
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd()
    paths = [cwd if p == "" else p for p in sys.path]
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    seen, out = set(), []
    for p in [*paths, *old]:
        if p not in seen and os.path.isdir(p) and not _installed_file(p):
            seen.add(p)
            out.append(p)
    if out:
        env["PYTHONPATH"] = os.pathsep.join(out + [p for p in old if p not in seen])
    return env
