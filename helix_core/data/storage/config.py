"""How remote samples are read: the caller's fsspec options (endpoints, regions; never secrets)
and Helix's own knobs (per-sample timeout, retries, range-read size, local cache)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RemoteConfig", "Storage", "check_storage_options"]

#: Option names that carry a credential. Helix refuses them: a dataset's arguments travel to every
#: DataServer in its spec and show in logs and configs, so credentials come from where fsspec and
#: the cloud SDKs look for them (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, instance roles,
#: GOOGLE_APPLICATION_CREDENTIALS, FSSPEC_<PROTOCOL>_<OPTION> variables, ~/.config/fsspec/*.json).
_SECRETS = {
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "session_token",
    "access_key",
    "secret_key",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "credentials",
    "account_key",
    "sas_token",
    "client_secret",
    "headers",  # an Authorization header
    "auth",
}


def check_storage_options(options: dict | None, *, where: str = "storage_options") -> dict:
    """``options`` as a plain JSON-able dict, or ``ValueError`` naming the first option that holds a
    credential (at any depth) or cannot travel as JSON."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"{where} must be a dict of fsspec options, got {type(options).__name__}")

    def walk(d: dict, at: str) -> None:
        for k, v in d.items():
            name = f"{at}[{k!r}]"
            if str(k).lower() in _SECRETS:
                raise ValueError(
                    f"{name} is a credential: Helix does not take credentials as arguments (they would "
                    "travel in the dataset's spec to every DataServer and show in logs); set them where "
                    "fsspec and the cloud SDKs read them: the environment (AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, FSSPEC_S3_KEY, ...), "
                    "~/.aws/credentials, or ~/.config/fsspec/*.json"
                )
            if isinstance(v, dict):
                walk(v, name)

    walk(options, where)
    try:
        return json.loads(json.dumps(options))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} must hold JSON values only (it travels to the DataServers): {e}") from None


@dataclass(frozen=True)
class RemoteConfig:
    """Helix's knobs for samples read by URL.

    ``timeout_s``: the most one sample's reads may take together, retries included (then a
    ``SampleError``); ``retries``: further tries of a read that failed transiently (a 5xx, a timeout,
    a reset connection), waiting ``backoff_s``, then twice that, ...; ``block_bytes``: the unit of a
    range read (a read after a seek fetches the blocks it touches; reads that go on sequentially
    fetch twice as many blocks per request each time, up to ``max_blocks // 2``); ``max_blocks``:
    blocks of one open object kept in memory; ``cache_dir`` / ``cache_bytes``: a local cache of fetched
    blocks shared by the processes of a host, bounded in bytes (off when ``cache_bytes`` is 0).
    """

    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 0.25
    block_bytes: int = 32 << 10
    max_blocks: int = 64
    cache_dir: str | None = None
    cache_bytes: int = 0

    def __post_init__(self):
        for name in ("timeout_s", "backoff_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"RemoteConfig.{name} must be a number >= 0, got {v!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"RemoteConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        for name, low in (("retries", 0), ("block_bytes", 4096), ("max_blocks", 1), ("cache_bytes", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"RemoteConfig.{name} must be an int >= {low}, got {v!r}")
        if self.cache_bytes and not self.cache_dir:
            raise ValueError("RemoteConfig.cache_bytes needs a cache_dir")

    @classmethod
    def of(cls, value: RemoteConfig | dict | None) -> RemoteConfig:
        """A ``RemoteConfig`` from itself, a dict of its fields (a YAML recipe's), or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"remote: unknown fields {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"remote must be a RemoteConfig or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Storage:
    """Where a dataset's remote samples are read from and how: fsspec ``options`` (checked by
    ``check_storage_options``) and Helix's ``remote`` knobs."""

    options: dict
    remote: RemoteConfig = RemoteConfig()

    @classmethod
    def of(cls, options: dict | None = None, remote: RemoteConfig | dict | None = None) -> Storage:
        return cls(check_storage_options(options), RemoteConfig.of(remote))

    def __hash__(self) -> int:
        return hash((json.dumps(self.options, sort_keys=True), self.remote))
