"""The obstore transport: S3 and GCS shard bytes moved by Rust's object_store (``obstore``),
which releases the GIL while it waits, signs and parses, instead of s3fs's and gcsfs's Python
event loop.

fsspec stays the resolver and the fallback. An ``s3://`` or ``gs://`` shard is read here when
obstore is installed and every storage option has an equivalent (:func:`store_object` says why
not, and the shard then goes through :mod:`cloudshards.source.remote`).

- S3 (:mod:`cloudshards.source.s3config`), as s3fs and botocore would read the options:
  ``key``/``secret``/``token``, ``anon``, ``profile``, the endpoint in every form s3fs accepts
  (:func:`~cloudshards.source.endpoints.store_endpoint`), the region (``client_kwargs``, the
  profile, ``AWS_REGION``/``AWS_DEFAULT_REGION``), ``requester_pays``, ``addressing_style``
  and ``verify=False``. Credentials come from botocore's own chain when none are given
  (environment, profiles, SSO, container and instance roles), refreshed when they expire.
- GCS (:mod:`cloudshards.source.gcsconfig`): gcsfs's own credentials object, built from the
  options by gcsfs, gives the bearer token; the endpoint is gcsfs's (``endpoint_url``,
  ``STORAGE_EMULATOR_HOST``, another universe).

Retries stay cloudshards' (bounded, counted, logged): obstore's own are off.

obstore's runtime does not survive ``fork``: a process forked after its parent used obstore
(a DataLoader worker whose main process read a shard first) reads through fsspec, and says so
once. Workers started with ``spawn``/``forkserver``, or forked before the main process read
anything, use obstore.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any, cast
from urllib.parse import urlsplit

from cloudshards import config
from cloudshards.errors import ConfigError
from cloudshards.process import PerProcess
from cloudshards.source.gcsconfig import DEFAULT_BASE_URL, gcs_settings, xml_api_missing
from cloudshards.source.kept import refuse_another_object
from cloudshards.source.objread import (
    NON_PARTIAL,
    ObstoreReader,
    object_details,
    obstore_call,
    translate_error,
)
from cloudshards.source.options import OpenOptions
from cloudshards.source.retries import PartialBodyError, RangeIgnoredError
from cloudshards.source.s3config import Unsupported, s3_settings
from cloudshards.source.stream import status_error
from cloudshards.urls import options_for, protocol_of

__all__ = ["ObstoreObject", "ObstoreReader", "forget", "store_object", "transport_setting"]

logger = logging.getLogger("cloudshards.fetch")

#: The fsspec backend each protocol obstore reads would otherwise go through.
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
# The process that first used obstore; a forked child of it must not (see the module doc).
_used_in_pid: int | None = None
_used_lock = threading.Lock()
_stores: PerProcess[dict[tuple[Any, ...], Any]] = PerProcess(dict)
_MAX_STORES = 64
_told: set[str] = set()


def forget() -> None:
    """Drop this process's stores and what it found out about endpoints (a GCS emulator's
    XML API), so that the next URL is set up afresh: for tests, whose servers come and go
    and whose ports another server may take later."""
    _stores.get().clear()
    _told.clear()


def transport_setting() -> str:
    """``CLOUDSHARDS_TRANSPORT``: ``auto`` (obstore where it can, else fsspec; the default),
    ``fsspec`` (never obstore) or ``obstore`` (an error where it cannot be used).

    Raises:
        ConfigError: Another value.
    """
    value = (config.env_str("TRANSPORT") or "auto").strip().lower()
    if value not in ("auto", "fsspec", "obstore"):
        raise ConfigError(f"CLOUDSHARDS_TRANSPORT must be auto, fsspec or obstore, not {value!r}")
    return value


def store_object(url: str, options: OpenOptions, *, stall_timeout_s: float) -> ObstoreObject | None:
    """The object at ``url`` read through obstore, or None when fsspec must read it.

    Raises:
        ConfigError: ``CLOUDSHARDS_TRANSPORT=obstore`` and obstore cannot read ``url``.
    """
    setting = transport_setting()
    protocol = protocol_of(url)
    if setting == "fsspec" or protocol not in _BACKENDS:
        return None
    if setting == "auto" and not options.obstore:
        return None
    try:
        store, key = _store_for(url, protocol, options, stall_timeout_s)
    except Unsupported as why:
        if setting == "obstore":
            raise ConfigError(f"CLOUDSHARDS_TRANSPORT=obstore, but {why}") from None
        told = f"{protocol}: {why}"
        if told not in _told:
            _told.add(told)
            # After a fork, or from an emulator without the XML API, the reads are slower than
            # they need be, for a reason the user can remove: say it. An option without
            # equivalent is the user's choice: only inform.
            level = logging.WARNING if why.fixable else logging.INFO
            level = logging.DEBUG if why.passing else level
            backend = _BACKENDS[protocol]
            logger.log(level, "reading %s:// through %s, not obstore: %s", protocol, backend, why)
        return None
    return ObstoreObject(store, key, url, pins_version=_BACKENDS[protocol] == "gcsfs")


def _store_for(
    url: str, protocol: str, options: OpenOptions, stall_timeout_s: float
) -> tuple[Any, str]:
    global _used_in_pid
    try:
        import obstore.store
    except ImportError:
        raise Unsupported("obstore is not installed (pip install obstore)") from None
    parts = urlsplit(url)
    if parts.query or parts.fragment or not parts.netloc:
        raise Unsupported("the URL has a query or fragment (a version?) or no bucket")
    bucket, key = parts.netloc, parts.path.lstrip("/")
    if any(segment in ("", ".", "..") for segment in key.split("/")):
        raise Unsupported("the key has an empty, '.' or '..' part, which obstore cannot name")
    with _used_lock:
        if _used_in_pid is not None and _used_in_pid != os.getpid():
            raise Unsupported(
                "obstore was used before this process was forked (start DataLoader workers "
                "with multiprocessing_context='spawn' or 'forkserver' to use it in workers)",
                fixable=True,
            )
        _used_in_pid = os.getpid()
    # Keyed by the user's options as given (secrets only as an in-memory key): the settings,
    # credentials chain and endpoint are worked out once per bucket and options.
    given = options_for(protocol, options.storage_options)
    cache_key = (
        _BACKENDS[protocol], bucket, repr(sorted(given.items(), key=lambda item: item[0])),
        stall_timeout_s,
    )  # fmt: skip
    stores = _stores.get()
    store = stores.get(cache_key)
    if store is None:
        gcs = _BACKENDS[protocol] == "gcsfs"
        settings = gcs_settings(url, options) if gcs else s3_settings(url, options)
        credentials = settings.pop("credentials", None)
        endpoint = str(settings.get("base_url" if gcs else "endpoint", ""))
        store = (obstore.store.GCSStore if gcs else obstore.store.S3Store)(
            bucket,
            config=settings,  # type: ignore[arg-type]
            client_options=_client_options(settings, endpoint, stall_timeout_s),  # type: ignore[arg-type]
            retry_config={"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=1)},
            credential_provider=credentials,
        )
        if gcs and endpoint != DEFAULT_BASE_URL and transport_setting() == "auto":
            store = xml_api_missing(store, key, url, options, endpoint) or store
        if len(stores) >= _MAX_STORES:  # options rebuilt with new objects in them, each epoch
            stores.pop(next(iter(stores)))
        stores[cache_key] = store
    if isinstance(store, Unsupported):
        raise store
    return store, key


def _client_options(
    settings: dict[str, Any], endpoint: str, stall_timeout_s: float
) -> dict[str, Any]:
    # A whole shard may stream for long: no request deadline, but a connection that delivers
    # nothing for ``stall_timeout_s`` fails (and is retried by cloudshards).
    stall = datetime.timedelta(seconds=stall_timeout_s)
    client: dict[str, Any] = {
        "timeout": datetime.timedelta(days=1),
        "read_timeout": stall,
        "connect_timeout": min(stall, datetime.timedelta(seconds=30)),
        "allow_http": endpoint.startswith("http://"),
    }
    if settings.pop("_insecure", False):
        client["allow_invalid_certificates"] = True
    return client


class ObstoreObject:
    """One store object read through obstore (see the module doc)."""

    #: Ranged GETs can be made conditional on the ETag (``if_match=``).
    conditional = True

    def __init__(self, store: Any, key: str, url: str, *, pins_version: bool = False) -> None:
        self.store = store
        self.key = key
        self.url = url
        # GCS: every GET after the first answer asks for that answer's generation (exact,
        # where fake-gcs-server ignores If-Match), instead of making the parts conditional.
        self._pins_version = pins_version
        self._version: str | None = None

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        """One HEAD: the size and ETag, under s3fs's names."""
        import obstore

        del timeout  # the store's read timeout is the stall timeout

        return object_details(obstore_call(obstore.head, self.store, self.key))

    def cat_range(
        self,
        start: int,
        end: int,
        timeout: float | None = None,
        if_match: str | None = None,
        expect_etag: str | None = None,
    ) -> bytes:
        """Bytes ``[start, end)`` (fewer when the object ends first), in one ranged GET (only
        while the object's ETag is ``if_match``, when given: else HTTP 412; ``expect_etag``:
        the same, without sending ``If-Match``)."""
        del timeout  # the store's read timeout is the stall timeout
        return bytes(self.cat_range_view(start, end, if_match, expect_etag))

    def cat_range_view(
        self, start: int, end: int, if_match: str | None = None, expect_etag: str | None = None
    ) -> memoryview:
        """:meth:`cat_range` without the copy into ``bytes``: a read-only view of the buffer
        obstore filled (the parts of a shard the tar reader slices members from)."""
        import obstore

        expect = if_match or expect_etag
        try:
            if expect is None and self._version is None:
                data = obstore_call(obstore.get_range, self.store, self.key, start=start, end=end)
                return memoryview(data)
            # Pinned to the first answer's generation (GCS), else conditional on its ETag,
            # which the answer must name too: a store may ignore If-Match (s3rver does).
            options: dict[str, Any] = {"range": (start, end)}
            if self._version is None and if_match is not None:
                options["if_match"] = if_match
            result = self._get(options)
            if self._version is None:
                refuse_another_object(result.meta.get("e_tag"), expect, missing_ok=True)
            return memoryview(obstore_call(result.bytes))
        except ConnectionError as exc:
            if NON_PARTIAL not in str(exc):
                raise
        # The store answered with the whole object (it ignores Range), which obstore refuses:
        # ask for it whole; its length tells the caller (RangeIgnoredError, then streaming).
        return memoryview(self.cat())

    def cat_range_salvage(
        self,
        start: int,
        end: int,
        timeout: float | None = None,
        if_match: str | None = None,
        expect_etag: str | None = None,
    ) -> bytes:
        """:meth:`cat_range`, streamed: an answer cut mid-body raises
        :class:`~cloudshards.source.retries.PartialBodyError` with the bytes that arrived.
        With ``expect_etag``, an answer naming another object (its ETag, or the pinned
        generation on GCS) is refused before its body is read, as a 412.

        Raises:
            RangeIgnoredError: The store answered with the whole object.
        """
        del timeout  # the store's read timeout is the stall timeout
        options: dict[str, Any] = {"range": (start, end)}
        if if_match is not None and self._version is None:
            options["if_match"] = if_match
        try:
            result = self._get(options)
        except ConnectionError as exc:
            if NON_PARTIAL not in str(exc):
                raise
            raise RangeIgnoredError(self.cat()) from None  # never joined onto kept bytes
        etag = result.meta.get("e_tag")
        if self._version and not (etag and etag[:2] != "W/"):
            etag = f'"{self._version}"'  # a pinned generation names the object as surely
        refuse_another_object(etag, expect_etag)
        received = bytearray()
        try:
            for chunk in result.stream(min_chunk_size=1):  # each as it arrives: none lost
                received += chunk
        except Exception as exc:
            size = result.meta.get("size")
            raise PartialBodyError(bytes(received), translate_error(exc), etag, size) from None
        return bytes(received)

    def remember(self, details: Mapping[str, Any]) -> None:
        """Pin the reads that follow to the generation ``details`` describe (GCS), unless
        pinned already: the parts of one read all come from one generation."""
        if self._pins_version and self._version is None and details.get("VersionId"):
            self._version = str(details["VersionId"])

    def _get(self, options: dict[str, Any] | None = None) -> Any:
        """One GET (obstore's result), of the pinned generation when there is one: a
        generation gone since (replaced, even by the same bytes, or deleted) answers as a
        failed If-Match would, HTTP 412, marked as such (an ETag cannot clear it)."""
        import obstore

        version = self._version
        if version is None:
            return obstore_call(obstore.get, self.store, self.key, options=options)
        pinned = {**(options or {}), "version": version}
        try:
            return obstore_call(obstore.get, self.store, self.key, options=pinned)
        except FileNotFoundError:
            error = status_error(f"generation {version} is gone (HTTP 412)", 412)
            error.generation_gone = True  # type: ignore[attr-defined]
            raise error from None

    def cat_first(
        self, end: int, on_details: Callable[[dict[str, Any]], None]
    ) -> tuple[bytes, dict[str, Any]]:
        """Bytes ``[0, end)`` (all of a shorter object) and the object's metadata, in one
        ranged GET: the answer's headers carry the size and ETag (no HEAD), handed to
        ``on_details`` as soon as they are in, before the body. A retry asks for the
        generation the first attempt saw (GCS)."""
        try:
            result = self._get({"range": (0, end)})
        except ConnectionError as exc:
            if NON_PARTIAL not in str(exc):
                raise
            result = self._get()  # ignores Range: see above
        except OSError as exc:
            if getattr(exc, "status", None) != 416:
                raise
            # An empty object has no byte 0 to range over: its metadata says so.
            details = self.info()
            if details.get("size") != 0:
                raise
            on_details(details)
            return b"", details
        details = object_details(result.meta)
        self.remember(details)
        on_details(details)
        return bytes(obstore_call(result.bytes)), details

    def cat(self) -> bytes:
        """The whole object in one GET (of the pinned generation, if any)."""
        return bytes(obstore_call(self._get().bytes))

    def open(self, block_bytes: int) -> IO[bytes]:
        """One streaming GET, started on the first read (a seek before it moves the start)."""
        return cast("IO[bytes]", ObstoreReader(self, block_bytes))
