"""Where a process finds its token: given, in a file, in ``HELIX_TOKEN``, or in the user's private
Helix folder, where a Coordinator leaves its token for the same user (``load_token``).

A Coordinator started without a token makes one (as Jupyter does) and writes it, mode 0600, to
``<folder>/coordinator-<host>-<port>.token``; the same user's DataServers, loaders and ``helix``
commands that are given no token find it by the Coordinator's address. Another user can read
neither the folder (0700) nor the file, so every RPC of theirs is refused.

The folder is ``HELIX_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/helix``, else
``~/.local/share/helix/runtime``; a lookup also tries ``/run/user/<uid>/helix`` and the home
folder (shells, cron and batch jobs differ in ``XDG_RUNTIME_DIR``). Loopback files carry the host
identity, so nodes that share an NFS home never read or remove each other's. Helix refuses a folder
or file that another user owns or can read, or a symlink (a clear ``ValueError`` naming it),
rather than trusting or leaking a token through it.

A token is sent only to a loopback port this user (or root) listens on (``listeners.py``, asked
before every call): a port another user took over after this user's Coordinator stopped never
receives it. Beyond loopback, TLS checks the peer.

The chain inside ``security/`` runs one way: ``auth`` (the token, its metadata, the rules of where
it may go) <- ``listeners`` (who holds a loopback port) <- this module.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from helix_core.security.auth import is_loopback
from helix_core.security.hostid import host_id
from helix_core.security.listeners import check_listener

RUN_USER = "/run/user"  # systemd-logind makes /run/user/<uid> (XDG_RUNTIME_DIR) for a login session

__all__ = ["find_token", "load_token", "remove_token", "runtime_dir", "token_path", "write_token"]


def _candidates() -> list[Path]:
    if os.environ.get("HELIX_RUNTIME_DIR"):
        return [Path(os.environ["HELIX_RUNTIME_DIR"])]
    out = [Path(os.environ["XDG_RUNTIME_DIR"]) / "helix"] if os.environ.get("XDG_RUNTIME_DIR") else []
    run_user = Path(RUN_USER) / str(os.getuid())
    if run_user.is_dir() and run_user / "helix" not in out:
        out.append(run_user / "helix")
    try:
        out.append(Path.home() / ".local" / "share" / "helix" / "runtime")
    except RuntimeError:  # no HOME and no passwd entry
        pass
    return out


def runtime_dir(create: bool = False) -> Path:
    """The user's private Helix folder (made 0700 when ``create``); refuses one not private to us."""
    candidates = _candidates()
    if not candidates:
        raise ValueError("no folder for Helix tokens: set HELIX_RUNTIME_DIR (or HOME)")
    path = candidates[0]
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        _check_private(path, "folder")
    return path


def _check_private(path: Path, what: str) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"Helix token {what} {path} is a symbolic link: remove it (Helix follows none)")
    if st.st_uid != os.getuid():
        raise ValueError(
            f"Helix token {what} {path} belongs to uid {st.st_uid}, not this user ({os.getuid()}): "
            "set HELIX_RUNTIME_DIR to a folder of your own"
        )
    if st.st_mode & 0o077:
        raise ValueError(
            f"Helix token {what} {path} is readable by other users (mode {stat.filemode(st.st_mode)}): "
            f"chmod {'700' if what == 'folder' else '600'} it, or remove it"
        )


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Coordinator address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _is_local(host: str) -> bool:
    """Loopback, or a wildcard bind (which loopback clients reach)."""
    return host in ("0.0.0.0", "::", "") or is_loopback(host)


def _host_key(host: str) -> str:
    if _is_local(host):
        return "loopback@" + re.sub(r"[^A-Za-z0-9._-]", "_", host_id())
    return re.sub(r"[^A-Za-z0-9._:-]", "_", host)


def token_path(address: str, folder: Path | None = None) -> Path:
    """Where the token of the Coordinator at ``address`` ("host:port") lives."""
    host, port = _split(address)
    return (folder or runtime_dir()) / f"coordinator-{_host_key(host)}-{port}.token"


def write_token(address: str, token: str) -> Path:
    """Write ``token`` for ``address`` (0600, atomically: no reader ever sees half a token)."""
    if not token:
        raise ValueError("write_token: an empty token")
    path = token_path(address, runtime_dir(create=True))
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        tmp.unlink(missing_ok=True)
        raise
    return path


def find_token(address: str | None) -> str | None:
    """The token a Coordinator of this user wrote for ``address``, or None (no file in any of the
    folders); ``ValueError`` for a file that is not private, or an address another user listens on."""
    if not address:
        return None
    for folder in _candidates():
        try:
            if not folder.exists():
                continue
            _check_private(folder, "folder")
            path = token_path(address, folder)
            if not path.exists() and not path.is_symlink():
                continue
            _check_private(path, "file")
            token = path.read_text().strip()
        except PermissionError:  # a folder we may not read (another user's HOME): no token there
            continue
        if token:
            check_listener(address)
            return token
    return None


def remove_token(address: str, token: str) -> None:
    """Remove ``address``'s token file if it still holds ``token`` (not a newer Coordinator's)."""
    try:
        path = token_path(address)
        if path.read_text().strip() == token:
            path.unlink()
    except (OSError, ValueError):
        pass


def load_token(token: str | None = None, token_file: str | None = None, coordinator: str | None = None) -> str | None:
    """The token from the argument, else the file, else ``HELIX_TOKEN``, else the one this user's
    Coordinator at ``coordinator`` left in the private Helix folder (``find_token``), else None."""
    if token:
        return token
    if token_file:
        try:
            with open(token_file) as f:
                mode = os.fstat(f.fileno()).st_mode
                if mode & 0o077:  # as the private Helix folder's files: a token others may read is no secret
                    raise ValueError(
                        f"token file {token_file} is open to other users (mode {stat.filemode(mode)}): "
                        f"chmod 600 {token_file}"
                    )
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read token file {token_file}: {e.strerror or e}") from None
        if not value:
            raise ValueError(f"token file {token_file} is empty")
        return value
    return os.environ.get("HELIX_TOKEN") or find_token(coordinator)
