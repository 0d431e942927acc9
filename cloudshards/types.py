"""Plain data types shared by every module: samples, members, shard descriptors, aliases."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from cloudshards.errors import ShardFormatError

__all__ = [
    "ClosingStream",
    "DecodeFn",
    "ExceptionHandler",
    "Member",
    "NameFilter",
    "Oversized",
    "Sample",
    "ShardInfo",
    "Stateful",
    "T",
    "T_co",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: A sample: ``{"__key__": str, "__url__": str, "<field>": bytes | decoded value, ...}``.
Sample = dict[str, Any]

#: Decodes one field's bytes into a value.
DecodeFn = Callable[[bytes], Any]

#: webdataset-style error handler: raise, or return True to continue / False to stop.
ExceptionHandler = Callable[[BaseException], bool]

#: Maps a member name to the name to use, or None to skip the member without reading it.
NameFilter = Callable[[str], "str | None"]


class Member(NamedTuple):
    """One regular file read from a tar stream.

    Attributes:
        name: Path of the member inside the archive (PAX/GNU long names resolved).
        data: The member's bytes.
        offset: Byte offset of the member's data in the (uncompressed) tar stream.
    """

    name: str
    data: bytes
    offset: int


class Oversized(NamedTuple):
    """The data of a member the tar reader did not read because it is larger than
    ``max_member_bytes``, given in its place with the name ``""`` when the reader is asked to
    go on past such members (``skip_oversized``): grouping, which skips members without a key,
    looks for it only there, so that it costs nothing per member.

    Attributes:
        name: The member's name as it would have been yielded (after the name filter).
        error: What the reader would have raised (naming the URL, the member as in the
            archive, and its header's offset).
    """

    name: str
    error: ShardFormatError


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard as the stages pass it around.

    Attributes:
        url: The shard URL as given (may hold a signed query string: never log it raw).
        index: Position of the shard in the epoch's shard order for this consumer.
    """

    url: str
    index: int = 0


class ClosingStream:
    """Mixin: a stream is its own context manager (``with stream:`` closes it), as files are."""

    def close(self) -> None:  # pragma: no cover - every stream defines it
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_S = TypeVar("_S", bound=ClosingStream)


class Stateful(Protocol):
    """Anything that can report and restore its position (torch's ``Stateful`` protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


SampleIterable = Iterable[Sample]
SampleIterator = Iterator[Sample]
