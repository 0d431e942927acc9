"""webdataset's fluent methods (``.shuffle``, ``.decode``, ``.to_tuple``, ``.batched``...).

Each returns a new pipeline with one more stage (:meth:`DataPipeline.compose`); the receiver is
never modified. Mixed into :class:`~cloudshards.pipeline.FluidWrapper`,
:class:`~cloudshards.dataset.WebDataset` and :class:`~cloudshards.dataset.WebLoader`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from cloudshards.handlers import reraise_exception
from cloudshards.stages import base, batch, fields, shuffle, transform
from cloudshards.stages.epoch import _slice
from cloudshards.types import ExceptionHandler

__all__ = ["FluidInterface"]


class FluidInterface:
    """webdataset's fluent methods; each returns a new pipeline with one more stage."""

    def compose(self, *args: Any) -> Any:  # provided by DataPipeline
        raise NotImplementedError

    def batched(
        self,
        batchsize: int,
        collation_fn: Callable[[list[Any]], Any] | None = batch.default_collation_fn,
        partial: bool = True,
    ) -> Any:
        """Group samples into batches (tensors and arrays stacked by the default collation)."""
        return self.compose(batch.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self) -> Any:
        """Split batches back into samples."""
        return self.compose(batch.unbatched())

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        """Group samples into plain lists (no collation). ``partial`` is ignored, as webdataset
        1.0.2 ignores it: the last list may be short."""
        return self.compose(batch.batched(batchsize, collation_fn=None))

    def unlisted(self) -> Any:
        """Flatten lists of samples."""
        return self.compose(batch.unlisted())

    def log_keys(self, logfile: str | None = None) -> Any:
        """Append sample keys to ``logfile``."""
        return self.compose(transform.log_keys(logfile))

    def shuffle(self, size: int, **kw: Any) -> Any:
        """Shuffle samples through a buffer of ``size`` (no-op when ``size < 1``)."""
        if size < 1:
            return self
        return self.compose(shuffle.shuffle(size, **kw))

    def map(self, f: Callable[[Any], Any], handler: ExceptionHandler = reraise_exception) -> Any:
        """Apply ``f`` to every sample."""
        decoders = sys.modules.get("cloudshards.decoders")  # f cannot be a Decoder without it
        if decoders is not None and type(f) is decoders.Decoder:
            # A decoder can be told the fields a to_tuple right after it keeps.
            return self.compose(transform.Decode(f, handler=handler))
        return self.compose(transform.map(f, handler=handler))

    def decode(
        self,
        *args: Any,
        pre: Any = None,
        post: Any = None,
        only: Any = None,
        partial: bool = False,
        handler: ExceptionHandler = reraise_exception,
        max_bytes: int | None = None,
        video: Any = None,
        audio: Any = None,
    ) -> Any:
        """Decode fields with imagespecs (``"rgb"``, ``"torchrgb"``, ``"pil"``...) or handlers.

        ``video=VideoClip(...)`` / ``audio=AudioClip(...)`` (or their arguments as dicts) decode
        video and audio fields as clips (:mod:`cloudshards.clips`) instead of whole.

        gzip, ``.npz``, ``.npy`` and ``.pth`` fields inflate to at most ``max_bytes``: by
        default the ``max_member_bytes`` given to this pipeline, else
        ``CLOUDSHARDS_MAX_DECODED_BYTES``, else ``CLOUDSHARDS_MAX_MEMBER_BYTES``, else 1 GiB.
        """
        from cloudshards.decoders import make_decoder

        if max_bytes is None:
            max_bytes = _member_limit(getattr(self, "pipeline", []))
        decoder = make_decoder(
            *args,
            pre=pre,
            post=post,
            only=only,
            partial=partial,
            max_bytes=max_bytes,
            video=video,
            audio=audio,
        )
        return self.compose(transform.Decode(decoder, handler=handler))

    def map_dict(self, handler: ExceptionHandler = reraise_exception, **kw: Any) -> Any:
        """Apply ``kw[field]`` to each sample's field."""
        return self.compose(transform.map_dict(handler=handler, **kw))

    def select(self, predicate: Callable[[Any], bool], **kw: Any) -> Any:
        """Keep samples for which ``predicate`` is true."""
        return self.compose(transform.select(predicate, **kw))

    def to_tuple(self, *args: Any, **kw: Any) -> Any:
        """Turn dict samples into tuples of fields (``"jpg;png"`` takes the first present).

        Right after a stage that can decode fewer fields (``.decode(...)``: its ``for_fields``),
        that stage is told the fields kept here: the others would be decoded only to be dropped.
        """
        result = self.compose(fields.to_tuple(*args, **kw))
        _narrow_previous(result.pipeline, args)
        return result

    def map_tuple(self, *args: Any, handler: ExceptionHandler = reraise_exception) -> Any:
        """Apply one function per tuple element."""
        return self.compose(transform.map_tuple(*args, handler=handler))

    def slice(self, *args: int | None) -> Any:
        """Take ``islice(stream, *args)`` of each epoch (per worker)."""
        return self.compose(base.FilterFunction(_slice, *args))

    def rename(self, **kw: Any) -> Any:
        """Rename fields, e.g. ``rename(image="jpg;png", label="cls")``."""
        return self.compose(fields.rename(**kw))

    def rsample(self, p: float = 0.5) -> Any:
        """Keep each sample with probability ``p``."""
        return self.compose(transform.rsample(p))

    def rename_keys(self, *args: Any, **kw: Any) -> Any:
        """Rename fields by glob patterns."""
        return self.compose(fields.rename_keys(*args, **kw))

    def extract_keys(self, *args: Any, **kw: Any) -> Any:
        """Turn samples into tuples of fields matched by glob patterns."""
        return self.compose(fields.extract_keys(*args, **kw))

    def mcached(self) -> Any:
        """Keep the first pass's samples in memory and replay them on later passes."""
        from cloudshards.replay import Cached

        return self.compose(Cached())

    def lmdb_cached(self, *args: Any, **kw: Any) -> Any:
        """Not supported (it pickles samples into LMDB): raises ``UnsupportedError``."""
        from cloudshards.replay import refuse_lmdb

        refuse_lmdb()

    def xdecode(self, *args: Any, **kw: Any) -> Any:
        """Decode fields by glob patterns (decoders receive a stream)."""
        return self.compose(fields.xdecode(*args, **kw))


def _member_limit(stages: list[Any]) -> int | None:
    """The ``max_member_bytes`` a reader stage was given explicitly, if any."""
    for stage in stages:
        limit = getattr(getattr(stage, "options", None), "max_member_bytes", None)
        if isinstance(limit, int):
            return limit
    return None


def _narrow_previous(stages: list[Any], kept: tuple[Any, ...]) -> None:
    """Tell the stage before the last (the one ``to_tuple`` follows) which fields the rest of
    the pipeline uses, if it declares ``for_fields`` (``.decode()``'s stage,
    :class:`~cloudshards.stages.transform.Decode`, does); it returns a narrowed copy, or None
    to stay as it is. Replaces the stage in ``stages``; shared objects are not modified."""
    if len(stages) < 2 or not kept or not all(isinstance(k, str) for k in kept):
        return
    for_fields = getattr(stages[-2], "for_fields", None)
    if not callable(for_fields):
        return
    # The names as to_tuple reads them: "jpg;png cls" (one string) is two fields, and a
    # field's alternatives are split on ";".
    narrowed = for_fields(
        {name for spec in kept for word in spec.split() for name in word.split(";")}
    )
    if narrowed is not None:
        stages[-2] = narrowed
