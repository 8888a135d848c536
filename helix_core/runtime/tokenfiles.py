"""The user's private Helix folder, where a Coordinator leaves its token for the same user.

A Coordinator started without a token makes one (as Jupyter does) and writes it, mode 0600, to
``<folder>/coordinator-<host>-<port>.token``; the same user's DataServers, loaders and ``helix``
commands that are given no token find it by the Coordinator's address. Another user can read
neither the folder (0700) nor the file, so every RPC of theirs is refused.

The folder is ``HELIX_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/helix``, else
``~/.local/share/helix/runtime``. Helix refuses a folder or file that another user owns or can
read (a clear ``ValueError`` naming it) rather than trusting or leaking a token through it.
"""
from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

__all__ = ["find_token", "remove_token", "runtime_dir", "token_path", "write_token"]


def runtime_dir(create: bool = False) -> Path:
    """The user's private Helix folder (made 0700 when ``create``); refuses one not private to us."""
    if os.environ.get("HELIX_RUNTIME_DIR"):
        path = Path(os.environ["HELIX_RUNTIME_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "helix"
    else:
        path = Path.home() / ".local" / "share" / "helix" / "runtime"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        _check_private(path, "folder")
    return path


def _check_private(path: Path, what: str) -> None:
    st = path.lstat()
    if st.st_uid != os.getuid():
        raise ValueError(f"Helix token {what} {path} belongs to uid {st.st_uid}, not this user ({os.getuid()}): "
                         "set HELIX_RUNTIME_DIR to a folder of your own")
    if stat.S_ISLNK(st.st_mode) or st.st_mode & 0o077:
        raise ValueError(f"Helix token {what} {path} is readable by other users (mode {stat.filemode(st.st_mode)}): "
                         f"chmod {'700' if what == 'folder' else '600'} it, or remove it")


def _host_key(host: str) -> str:
    host = host.strip("[]")
    if host == "localhost":
        return "loopback"
    try:
        return "loopback" if ipaddress.ip_address(host).is_loopback else host
    except ValueError:
        return host


def token_path(address: str) -> Path:
    """Where the token of the Coordinator at ``address`` ("host:port") lives."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Coordinator address {address!r} is not host:port")
    return runtime_dir() / f"coordinator-{_host_key(host)}-{port}.token"


def write_token(address: str, token: str) -> Path:
    """Write ``token`` for ``address`` (0600, atomically: no reader ever sees half a token)."""
    runtime_dir(create=True)
    path = token_path(address)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def find_token(address: str | None) -> str | None:
    """The token a Coordinator of this user wrote for ``address``, or None (no file, or no folder)."""
    if not address:
        return None
    try:
        path = token_path(address)
        if not path.exists():
            return None
        _check_private(path, "file")
        return path.read_text().strip() or None
    except PermissionError:  # a folder we may not read (another user's HOME): we have no token there
        return None


def remove_token(address: str, token: str) -> None:
    """Remove ``address``'s token file if it still holds ``token`` (not a newer Coordinator's)."""
    try:
        path = token_path(address)
        if path.read_text().strip() == token:
            path.unlink()
    except (OSError, ValueError):
        pass
