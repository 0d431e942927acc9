"""A download that did not match the store's checksum is fetched once more and compared, to
tell which of its bytes (if any) were wrong (see :class:`~cloudshards.cache.tee.TeeStream`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cloudshards.cache.facts import Checksum, Hasher
from cloudshards.cache.stats import CacheStats
from cloudshards.redact import redact_url
from cloudshards.source import ShardSource

__all__ = ["WHY", "recheck_download"]

logger = logging.getLogger(__name__)


def recheck_download(
    refetch: Callable[[], ShardSource],
    stats: CacheStats,
    *,
    url: str,
    served: int,
    size: int | None,
    checksum: Checksum,
    first_hex: str,
    prefix: Hasher | None,
) -> tuple[str, bytes]:
    """Download the object once more, and compare.

    Args:
        refetch: Opens the object again from its start.
        stats: Counts the bytes fetched.
        url: The object (for the log).
        served: Bytes of the first download already served (the rest was held back).
        size: The size the store reported.
        checksum: The store's checksum.
        first_hex: The checksum (hex) of the whole first download.
        prefix: The checksum state of the first download's ``served`` bytes (None: none).

    Returns:
        ``("tail", bytes)`` when the second download matches the checksum and agrees with the
        first on every byte already served (only held-back bytes were wrong: serve the
        second's); ``("checksum", b"")`` when both downloads agree with each other, not with
        the checksum (it is not a checksum of the bytes); otherwise ``("prefix", b"")`` (bytes
        already served were wrong), ``("changed", b"")`` (the object differs each time) or
        ``("failed", b"")`` (the second download failed).
    """
    whole = checksum.hasher()
    second_prefix = checksum.hasher()
    tail, position = bytearray(), 0
    try:
        stream = refetch()
        try:
            while chunk := stream.read(1 << 22):
                stats.bytes_network += len(chunk)
                whole.update(chunk)
                cut = max(0, min(len(chunk), served - position))
                second_prefix.update(chunk[:cut])
                tail += chunk[cut:]
                position += len(chunk)
                if position > (size or 0):
                    return "changed", b""
        finally:
            stream.close()
    except OSError as exc:  # the store is unreachable now: nothing can be vouched for
        logger.debug("cache: refetching %s failed: %s", redact_url(url), exc)
        return "failed", b""
    # No prefix hash: nothing came before the held-back bytes (an empty object).
    first = (prefix or checksum.hasher()).digest()
    if position != size:
        return "changed", b""
    if whole.hexdigest() == checksum.hexdigest:
        return ("tail", bytes(tail)) if second_prefix.digest() == first else ("prefix", b"")
    if whole.hexdigest() == first_hex:
        return "checksum", b""
    return "changed", b""


#: Why a download that did not match its checksum may have served wrong bytes, per verdict of
#: :func:`recheck_download`.
WHY = {
    "prefix": "and a second download (which does) differs in bytes already read: they were "
    "corrupted in transit; read the shard again",
    "changed": "nor does a second download: the object changed while it was read; read the "
    "shard again",
    "failed": "and a second download to check it failed; read the shard again",
}
