"""The streaming tar reader: the regular files of a tar stream (plain, gzip, bzip2 or xz) as
Members.

:func:`iter_members` (:mod:`~cloudshards.tar.members`) reads headers, PAX and GNU extensions,
gzip and limits; :mod:`~cloudshards.tar.headers` decodes single header fields (indexed reads
check member headers with it); :mod:`~cloudshards.tar.blocks` and
:mod:`~cloudshards.tar.decompress` are its buffered, bounded reads.
"""

from __future__ import annotations

from cloudshards.tar.members import GZIP_MAGIC, ReadableStream, iter_members

__all__ = ["GZIP_MAGIC", "ReadableStream", "iter_members"]
