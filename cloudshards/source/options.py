"""How shards are opened and fetched: the two frozen option dataclasses of the shard source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cloudshards import config
from cloudshards.errors import ConfigError

__all__ = ["FetchOptions", "OpenOptions"]

#: The FetchOptions fields read from ``CLOUDSHARDS_<variable>`` when not given.
_ENV_FIELDS = {
    "prefetch": "PREFETCH",
    "part_bytes": "PART_BYTES",
    "concurrency": "CONCURRENCY",
    "retries": "RETRIES",
    "throttle_retries": "THROTTLE_RETRIES",
    "stall_timeout_s": "STALL_TIMEOUT_S",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenOptions:
    """How shards are opened.

    Attributes:
        storage_options: Per-protocol fsspec options (``{"s3": {...}}``) or one flat mapping.
        allow_pipe: Allow ``pipe:CMD`` URLs, which run ``CMD`` in a shell. Off by default;
            ``CLOUDSHARDS_ALLOW_PIPE=1`` turns it on when this is None.
        block_bytes: Size of each read from the store.
        max_member_bytes: Largest tar member read into memory (a guard against hostile or
            corrupt headers); None means ``CLOUDSHARDS_MAX_MEMBER_BYTES`` or 1 GiB.
        obstore: Whether the bytes may go through obstore (under ``CLOUDSHARDS_TRANSPORT=auto``);
            False reads through fsspec, as a main process's small reads do (``gopen``): a
            process forked after it used obstore cannot use it.
    """

    # Never in the repr: it holds credentials.
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    allow_pipe: bool | None = None
    block_bytes: int = config.DEFAULT_BLOCK_BYTES
    max_member_bytes: int | None = None
    obstore: bool = True

    def member_limit(self) -> int:
        """The member size limit, after the environment default."""
        if self.max_member_bytes is not None:
            return self.max_member_bytes
        return config.env_int("MAX_MEMBER_BYTES", config.DEFAULT_MAX_MEMBER_BYTES)

    def sample_limit(self) -> int:
        """Most bytes one sample may hold: one field at the member limit and its small
        companions fit (see :func:`~cloudshards.grouping.group_members`)."""
        return 2 * self.member_limit()

    def pipe_allowed(self) -> bool:
        """Whether ``pipe:`` URLs may run, after the environment default (never under
        webdataset's ``WDS_SECURE``)."""
        if config.webdataset_secure():
            return False
        if self.allow_pipe is not None:
            return self.allow_pipe
        return config.env_bool("ALLOW_PIPE", False)


def pipe_advice() -> str:
    """Why a ``pipe:`` command was refused, and how to allow it, for error messages."""
    if config.webdataset_secure():
        return "refused under WDS_SECURE (webdataset's enforce_security)"
    return "off by default; pass allow_pipe=True or set CLOUDSHARDS_ALLOW_PIPE=1 to allow them"


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchOptions:
    """How remote shards are fetched.

    Attributes:
        prefetch: Shards opened ahead of the one being read (0 turns prefetch off).
        part_bytes: Size of each ranged GET.
        concurrency: Ranged GETs in flight per shard.
        retries: Further attempts after a failed request (0: no retry).
        throttle_retries: Attempts beyond ``retries`` for a request the store asked to slow
            down (503 SlowDown, 429), as long as the request's tries stay within
            :attr:`give_up_s`: throttling passes once the node has slowed down, which takes
            longer than ``retries`` quick tries.
        backoff_s: First retry delay; doubles each time, with full jitter.
        max_backoff_s: Cap on one retry delay.
        stall_timeout_s: A try of a request that makes no progress for this long is
            abandoned, and retried as any other failure (see :attr:`give_up_s`).
        adaptive: Size the parts from the measured link (:mod:`cloudshards.source.adapt`),
            holding at most ``concurrency x part_bytes`` per shard; :meth:`from_env` turns it
            on unless ``part_bytes`` or ``concurrency`` is given (argument or variable).
    """

    # Defaults measured with benchmarks/bench_remote.py (30 ms before each request, 25 MB/s per
    # connection, 20 MiB shards), samples/s: 2 MiB x 16 11,882 (the simulator's link with 24
    # raw connections: 13,484), 2 MiB x 32 10,740, 2 MiB x 8 5,843, 4 MiB x 8 8,568, 1 MiB x
    # 16 7,461. What counts is the number of GETs in flight: a prefetched shard stops when its
    # window is full, so the window of the shard being read carries the link. Memory bound:
    # (2 + 1) x 16 x 2 MiB = 96 MiB.
    prefetch: int = 2
    part_bytes: int = 2 << 20
    concurrency: int = 16
    retries: int = 5
    throttle_retries: int = 10
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    stall_timeout_s: float = 120.0
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.part_bytes < 1 << 16:
            raise ConfigError(f"part_bytes must be >= 64 KiB, got {self.part_bytes}")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.retries < 0 or self.throttle_retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}, {self.throttle_retries}")
        if self.stall_timeout_s <= 0:
            raise ConfigError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")

    @classmethod
    def from_env(cls, **overrides: Any) -> FetchOptions:
        """Defaults from ``CLOUDSHARDS_PREFETCH``, ``..._PART_BYTES``, ``..._CONCURRENCY``,
        ``..._RETRIES``, ``..._THROTTLE_RETRIES``, ``..._STALL_TIMEOUT_S``; explicit
        (non-None) overrides win, and the variable of a field they give is not read."""
        defaults = cls()
        values: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        if "adaptive" not in values:
            fixed = ("part_bytes", "concurrency")
            values["adaptive"] = not any(
                name in values or config.env_str(_ENV_FIELDS[name]) is not None for name in fixed
            )
        for name, variable in _ENV_FIELDS.items():
            if name not in values:
                default = getattr(defaults, name)
                value = config.env_int(variable, int(default))
                values[name] = float(value) if isinstance(default, float) else value
        return cls(**values)

    @property
    def give_up_s(self) -> float:
        """The longest one request takes through all its tries before it fails for good:
        ``retries + 1`` tries of at most ``stall_timeout_s`` each and the backoff between
        them (tries for throttling, ``throttle_retries``, end within it too). A reader waits
        a little longer for a part (:attr:`reader_wait_s`)."""
        backoff = sum(min(self.max_backoff_s, self.backoff_s * 2.0**n) for n in range(self.retries))
        # A second a try beyond its stall bound: a transport's own backstop, a lookup inside it.
        return (self.retries + 1) * (self.stall_timeout_s + 1.0) + backoff

    @property
    def reader_wait_s(self) -> float:
        """How long a reader waits for a part (or a cache follower for the download's first
        bytes) before it calls the store stalled: :attr:`give_up_s` and a second more, so a
        backend whose tries cannot be bounded still ends in an error, and a request's own
        last try fails first where it can."""
        return self.give_up_s + 1.0

    @property
    def max_buffered_bytes(self) -> int:
        """Upper bound on the bytes held in memory: (prefetch + 1) x concurrency x part."""
        return (self.prefetch + 1) * self.concurrency * self.part_bytes
