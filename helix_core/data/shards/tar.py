"""The tar format, read header by header (pure: bytes in, members out).

A shard is walked without ``tarfile``: its stream reader stops silently at a corrupt header after
the first, and a shard's index must say where and why it stopped. This reads POSIX ustar (with its
name prefix), GNU long names (``L``), pax extended headers (``x``: ``path`` and ``size``) and
base-256 sizes, and yields each regular file's name and the offset and size of its data (not of its
header), so that a sample is later one range read of exactly its bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

__all__ = ["BLOCK", "Member", "TarFormatError", "members"]

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")  # a file, an old-style file, a contiguous file
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, fifos (as tarfile reads them)
_POSIX_MAGIC = b"ustar\x00"


class TarFormatError(ValueError):
    """The shard is not a readable tar from byte ``offset`` on: ``cause`` says why."""

    def __init__(self, offset: int, cause: str):
        self.offset, self.cause = int(offset), str(cause)
        super().__init__(f"byte {self.offset}: {self.cause}")


class Member(NamedTuple):
    """A regular file in the tar: its ``name``, where its data starts (``offset``, bytes from the
    start of the shard) and its ``size`` in bytes (as the header says: past the shard's end when
    the shard is truncated)."""

    name: str
    offset: int
    size: int


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _number(field: bytes, at: int, what: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 (sizes of 8 GiB and more)
        value = int.from_bytes(field[1:], "big")
        return -value if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(at, f"not a tar header ({what} field {field!r} is not a number)") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _check(block: bytes, at: int) -> None:
    stored = _number(block[148:156], at, "checksum")
    unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b >= 0x80)
    if stored not in (unsigned, signed):
        raise TarFormatError(at, "not a tar header (checksum mismatch)")


def _pax(data: bytes, at: int) -> dict[str, str]:
    """A pax extended header's records (``"%d %s=%s\\n"``) as a dict."""
    out, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] not in (b"", b"\0"):
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarFormatError(at, "malformed pax header") from None
        record = data[space + 1 : pos + length - 1]  # without the newline
        key, _, value = record.partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        if length <= 0:
            raise TarFormatError(at, "malformed pax header")
        pos += length
    return out


def members(read: Callable[[int, int], bytes], size: int) -> Iterator[Member]:
    """The regular files of a tar of ``size`` bytes whose bytes ``read(offset, n)`` returns, in
    order. A member whose data runs past ``size`` is still yielded (its sample is then truncated);
    a corrupt header or a header cut by the end raises ``TarFormatError`` at its offset. The walk
    ends at the end-of-archive zero blocks or at ``size`` on a block boundary."""
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos < size:
        if pos + BLOCK > size:
            raise TarFormatError(pos, f"truncated: a header is cut by the end of the shard at byte {size}")
        block = read(pos, BLOCK)
        if block == _ZERO:
            return  # end of archive (a second zero block and padding follow)
        _check(block, pos)
        kind = block[156:157]
        length = _number(block[124:136], pos, "size")
        data = pos + BLOCK
        if kind in (b"L", b"x", b"g", b"K"):
            if data + length > size:
                raise TarFormatError(pos, f"truncated: an extended header is cut by the end of the shard at {size}")
            body = read(data, length)
            if kind == b"L":
                long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == b"x":
                pax = _pax(body, pos)
            pos = data + _padded(length)  # a global header ("g") or a long link name ("K"): not needed
            continue
        name = _text(block[0:100])
        if block[257:263] == _POSIX_MAGIC and block[345:346] != b"\0":
            name = _text(block[345:500]) + "/" + name
        name = pax.get("path", long_name or name)
        if "size" in pax:
            try:
                length = int(pax["size"])
            except ValueError:
                raise TarFormatError(pos, f"pax size {pax['size']!r} is not a number") from None
        if kind in _REGULAR and not (kind == b"\0" and name.endswith("/")):
            yield Member(name, data, length)
        long_name, pax = None, {}
        pos = data if kind in _NO_DATA else data + _padded(length)
