"""The shard source: the only code that turns a shard URL into bytes.

:func:`open_source` opens a shard (a local file, a ``pipe:`` command, a store object read as
parallel ranged GETs or one resumable GET, or through the node cache); :class:`ShardPrefetcher`
keeps the next shards in flight; :mod:`cloudshards.source.transport` picks the transport of
each store object: obstore (:mod:`cloudshards.source.objstore`) for ``s3://`` and ``gs://``
where it can, else fsspec (:mod:`cloudshards.source.remote`, the one module that calls an
fsspec filesystem to read bytes or metadata). A new transport plugs in there.
"""

from __future__ import annotations

from cloudshards.source.local import (
    PipeWriter,
    is_local,
    is_local_file,
    local_path,
    open_local_fd,
    pipe_program,
    serve_user_openers,
    user_opener,
    user_output,
)
from cloudshards.source.opener import (
    EntrySource,
    NodeCache,
    ShardSource,
    StoreOpener,
    open_source,
    store_opener,
)
from cloudshards.source.options import FetchOptions, OpenOptions, pipe_advice
from cloudshards.source.parts import PartStream
from cloudshards.source.plain import gopen, open_shard, shard_size
from cloudshards.source.prefetch import ShardPrefetcher, current_thread_count
from cloudshards.source.remote import object_etag, open_output
from cloudshards.source.resumable import ResumableStream, open_remote
from cloudshards.source.retries import (
    IOStats,
    RangeIgnoredError,
    is_retryable,
    process_stats,
    retry,
)
from cloudshards.source.stream import ShardStream, discard, map_backend_error
from cloudshards.source.transport import (
    StoreObject,
    fetch_range,
    object_at,
    object_info,
    read_object,
    read_range,
)

__all__ = [
    "EntrySource",
    "FetchOptions",
    "IOStats",
    "NodeCache",
    "OpenOptions",
    "PartStream",
    "PipeWriter",
    "RangeIgnoredError",
    "ResumableStream",
    "ShardPrefetcher",
    "ShardSource",
    "ShardStream",
    "StoreObject",
    "StoreOpener",
    "current_thread_count",
    "discard",
    "fetch_range",
    "gopen",
    "is_local",
    "is_local_file",
    "is_retryable",
    "local_path",
    "map_backend_error",
    "object_at",
    "object_etag",
    "object_info",
    "open_local_fd",
    "open_output",
    "open_remote",
    "open_shard",
    "open_source",
    "pipe_advice",
    "pipe_program",
    "process_stats",
    "read_object",
    "read_range",
    "retry",
    "serve_user_openers",
    "shard_size",
    "store_opener",
    "user_opener",
    "user_output",
]
