# ruff: noqa: E501  (REVIEWED_EQUIVALENTS keys are whole mutant keys, one string each)
"""Mutation check of the code whose mistakes cost the most: `tox -e mutation`.

Four areas, each with the test files that guard it:

- ``tar``: the tar reader (``tar/members.py``, ``tar/headers.py``, ``tar/blocks.py``) and the
  cache's member tables (``cache/membertable.py``);
- ``cache``: the node cache's commit path (reserve, write, verify, rename/commit, unlock, and the
  follower's reads) in the ``cache/`` package (``shardcache.py``, ``budget.py``, ``tee.py``,
  ``follow.py``, ``lock.py``, ``facts.py``);
- ``balance``: ``balance.py`` (``assign_samples``, the counts key, the counting pass);
- ``redaction``: ``redact.py``.

Each mutant is one small change made with :mod:`ast` in one of the functions named in
:data:`AREAS`: a comparison or arithmetic operator swapped (``<`` / ``<=``, ``==`` / ``!=``,
``is`` / ``is not``, ``in`` / ``not in``, ``+`` / ``-``, ...), ``and`` / ``or``, ``min`` /
``max``, an integer off by one, ``True`` / ``False``, a condition negated, a ``not`` dropped, a
statement removed (a ``raise``, a call such as an unlock, rename or flush, an early ``return``,
a counter update, an attribute assignment), and in the cache's commit path two adjacent
statements swapped (one of them a call). Logging calls and the cache's test checkpoints are
left alone. Each mutant is applied to a copy of the working tree (tracked and untracked, not
ignored, files), never to the checkout itself, and the area's tests run against it with
``-x -q`` and a per-test timeout. A run past the timeout counts as caught, and is listed.

Tests first run are those that execute the mutated lines, fastest first: recorded once per
area on the unmutated copy with coverage, one context per test (processes a test forks are
measured too, ``patch = fork``; processes it spawns are not). A mutant those tests miss is run
against all of the area's test files before it counts as surviving (``--no-confirm`` skips
that: faster, but a test that relies on state another test left, such as a log record factory
installed once per process, is then not seen). A mutant listed in
:data:`REVIEWED_EQUIVALENTS` (reviewed: no test can tell it from the original; "performance
only" marks the ones that change read sizes and nothing else) is not run nor counted.

Why not mutmut 3 (evaluated on ``redact.py``; it runs and can be restricted by file, mutant
name and test files): with its default ``fork`` isolation every mutant runs in a fork of the
process that already ran the suite, so state set up once per process is the unmutated code's
(``install_log_redaction`` wraps the log record factory once): a mutant setting
``record = None`` in that factory "survived" although ``tests/test_redaction.py`` fails on it.
Its ``forkserver`` isolation gets that right but ran 0.6 mutants/s here (over an hour for the
four areas on 2 cores). It also takes one test selection for every module, not one per area,
records reviewed equivalents only as ``# pragma: no mutate`` in the library's own source, names
mutants by position (``x_scrubbed__mutmut_17``: names move when the code does), and most of its
survivors were string mutants of messages (``"XXerrnoXX"``). Here, reviewed equivalents are
keyed by file, function and text (:attr:`Mutant.key`), so they survive edits elsewhere.

Usage::

    tox -e mutation                                     # all areas (about an hour on 2 cores)
    python integration/mutation.py --area tar --jobs 2
    python integration/mutation.py --list --area cache  # the mutants, not run
    python integration/mutation.py --only "tar/headers"  # mutants whose key contains this
    python integration/mutation.py --survivors-of run.json  # what survived an earlier --json
    python integration/mutation.py --sample 100 --seed 1
    python integration/mutation.py --strict             # exit 1 if a mutant survives

Every process that runs tests imports ``cloudshards`` from the copy (``PYTHONPATH``); this
process never imports it (tests run in forks of it, after torch, pytest and the other heavy
imports, so each mutant costs its tests rather than an interpreter start; ``--isolation
subprocess`` starts a fresh ``python -m pytest`` instead).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fnmatch
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GAPS = "tests/cache/test_mutation_gaps.py"


@dataclasses.dataclass(frozen=True)
class Area:
    """Functions to mutate (``{path: qualname patterns}``, fnmatch; a function's nested
    functions go with it) and the test files that must catch the mutants."""

    targets: dict[str, tuple[str, ...]]
    tests: tuple[str, ...]
    #: Functions (qualname patterns) where adjacent statements are also swapped.
    swap: tuple[str, ...] = ()


AREAS: dict[str, Area] = {
    "tar": Area(
        targets={
            "cloudshards/tar/members.py": ("*",),
            "cloudshards/tar/headers.py": ("*",),
            "cloudshards/tar/blocks.py": ("*",),
            "cloudshards/tar/decompress.py": ("*",),
            "cloudshards/cache/membertable.py": ("*",),
        },
        tests=(
            "tests/tar/test_tar.py",
            "tests/tar/test_tar_safety.py",
            "tests/tar/test_tar_fuzz.py",
            "tests/cache/test_membertable.py",
            GAPS,
        ),
    ),
    "cache": Area(
        targets={
            "cloudshards/cache/shardcache.py": (
                "ShardCache._claim",
                "ShardCache._take_over",
                "ShardCache._open_hit",
                "ShardCache._download",
            ),
            "cloudshards/cache/budget.py": ("CacheBudget._reserve",),
            "cloudshards/cache/tee.py": ("TeeStream.*",),
            "cloudshards/cache/recheck.py": ("recheck_download",),
            "cloudshards/cache/follow.py": ("FollowStream.*",),
            "cloudshards/cache/handoff.py": ("Handoff.*",),
            "cloudshards/cache/lock.py": (
                "DownloadLock.*",
                "is_locked",
                "is_poisoned",
            ),
            "cloudshards/cache/facts.py": (
                "remote_facts",
                "trusted_checksum",
                "trusted_md5",
                "_gcs_md5",
                "_gcs_field",
                "_s3_md5",
                "Checksum.*",
                "_Crc32c.*",
                "_is_aws",
                "_store_key",
                "distrust_checksums",
                "_distrusted",
            ),
        },
        tests=(
            "tests/cache/test_cache.py",
            "tests/cache/test_cache_ahead.py",
            "tests/cache/test_cache_order.py",
            "tests/cache/test_cache_safety.py",
            "tests/cache/test_tee.py",
            "tests/cache/test_follow.py",
            "tests/cache/test_handoff.py",
            "tests/cache/test_membertable.py",
            GAPS,
            # Checksums are trusted only from real stores (S3 single-part ETags, GCS crc32c and
            # md5Hash):
            # the hold-back and recheck paths run against moto and the GCS emulator only.
            "integration/test_cache_safety_remote.py",
        ),
        swap=(
            "ShardCache._download*",
            "CacheBudget._reserve",
            "ShardCache._open_hit",
            "TeeStream.*",
            "recheck_download",
            "FollowStream.*",
            "DownloadLock.*",
        ),
    ),
    "balance": Area(
        targets={"cloudshards/balance.py": ("*",)},
        tests=("tests/test_balance.py", GAPS),
    ),
    "redaction": Area(
        targets={"cloudshards/redact.py": ("*",)},
        tests=("tests/test_redaction.py", GAPS),
    ),
}

#: Mutants reviewed as equivalent (no test can tell them from the original), by key (see
#: :attr:`Mutant.key`), with the reason. They are listed in the report but not counted.
REVIEWED_EQUIVALENTS: dict[str, str] = {
    # --- tar ----------------------------------------------------------------------------------
    "cloudshards/tar/members.py:_iter_members: -1 → -2": "ext_offset -1 means none; only ever compared with >= 0",
    "cloudshards/tar/members.py:_iter_members: -1 → -2 #3": "ext_offset -1 means none; only ever compared with >= 0",
    "cloudshards/tar/members.py:_iter_members: -1 → -2 #4": "ext_offset -1 means none; only ever compared with >= 0",
    "cloudshards/tar/members.py:_iter_members: len(buf) - pos < BLOCK → len(buf) - pos <= BLOCK": (
        "with exactly one block left, rd.fill(BLOCK) returns at once and changes nothing"
    ),
    "cloudshards/tar/members.py:_iter_members: return → pass": "rd.finish_at_eof() always raises",
    "cloudshards/tar/members.py:_iter_members: data_offset + padded > MAX_OFFSET → data_offset + padded >= MAX_OFFSET": (
        "offsets and padded sizes are multiples of 512, MAX_OFFSET (2**63 - 1) is odd"
    ),
    "cloudshards/tar/members.py:_iter_members: pos + padded <= len(buf) → pos + padded < len(buf)": (
        "a member ending exactly at the buffer's end takes rd.skip_or_raise: same position"
    ),
    "cloudshards/tar/members.py:_iter_members: end <= len(buf) → end < len(buf)": (
        "a member ending exactly at the buffer's end takes rd.take_or_raise: same bytes"
    ),
    "cloudshards/tar/members.py:_iter_members: pos + padded <= len(buf) → pos + padded < len(buf) #2": (
        "an extended header ending exactly at the buffer's end takes rd.take_or_raise: same bytes"
    ),
    "cloudshards/tar/members.py:_iter_members: pos + padded <= len(buf) → pos + padded < len(buf) #3": (
        "an entry ending exactly at the buffer's end takes rd.skip_or_raise: same position"
    ),
    "cloudshards/tar/headers.py:checksum_ok: return False → pass": (
        "stored is None: the signed comparison after it is False as well"
    ),
    "cloudshards/tar/headers.py:parse_pax: pos < end → pos <= end": (
        "at pos == end no length is found and the empty remainder ends the loop"
    ),
    "cloudshards/tar/headers.py:parse_pax: space > pos → space >= pos": (
        "space == pos slices the same empty length text"
    ),
    "cloudshards/tar/headers.py:parse_pax: stop <= space + 1 → stop < space + 1": (
        "a record ending at its length's space fails the newline check: same error"
    ),
    "cloudshards/tar/headers.py:parse_pax: space + 1 → space + 0": (
        "a record ending at its length's space fails the newline check: same error"
    ),
    "cloudshards/tar/headers.py:parse_pax: space + 1 → space - 1": (
        "records that short end in a digit or the space: the newline check, same error"
    ),
    # The spare block (609377c): spare_pos is read only while spare is non-empty, and is set
    # with it; reads of the spare ask for at least what is left of it (fill takes longer
    # chunks as they come): these change how bytes are cut, never which bytes, in which order.
    "cloudshards/tar/blocks.py:BlockReader.__init__: self.spare_pos = 0 → pass": "spare_pos is read only while spare is non-empty; set with it",
    "cloudshards/tar/blocks.py:BlockReader.__init__: 0 → 1 #3": "spare_pos is read only while spare is non-empty; set with it",
    "cloudshards/tar/blocks.py:BlockReader._drop_spare: self.spare_pos = 0 → pass": "spare_pos is read only while spare is non-empty; set with it",
    "cloudshards/tar/blocks.py:BlockReader._drop_spare: 0 → 1": "spare_pos is read only while spare is non-empty; set with it",
    "cloudshards/tar/blocks.py:BlockReader.__init__: self._stream_read = self.read → pass": "the fill in __init__ runs with seekable set, which short-circuits the check; set again below",
    "cloudshards/tar/blocks.py:BlockReader.fill: len(self.spare) - self.spare_pos >= need → len(self.spare) - self.spare_pos > need": "performance only: an exact fit is read through _read_spare instead (same bytes)",
    "cloudshards/tar/blocks.py:BlockReader._read_spare: size < 0 → not (size < 0)": "every read of the spare asks for at least its rest, or is a fill that takes longer chunks",
    "cloudshards/tar/blocks.py:BlockReader._read_spare: size < 0 → size <= 0": "never called with 0 (every caller asks for a positive size)",
    "cloudshards/tar/blocks.py:BlockReader._read_spare: size < 0 → size < 1": "never called with 0 (every caller asks for a positive size)",
    "cloudshards/tar/blocks.py:BlockReader._read_spare: len(spare) if size < 0 else min(len(spare), start + size) → len(spare) if size < 0 else max(len(spare), start + size)": "every read of the spare asks for at least its rest, or is a fill that takes longer chunks",
    "cloudshards/tar/blocks.py:BlockReader.skip: size <= self.block_bytes → size < self.block_bytes": "performance only: a skip of exactly one block reads it in the loop instead of through fill",
    "cloudshards/tar/decompress.py:DecompressReader.__init__: max(block_bytes, BLOCK) → min(block_bytes, BLOCK)": (
        "performance only: smaller decompressed chunks, same bytes and errors"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: avail >= need → avail > need": (
        "with exactly `need` bytes the other path rebases the buffer and returns True"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: return True → pass": (
        "the other path rebases the buffer and returns True as well"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: True → False": (
        "reached only where the result is ignored: the tar loop and _take call fill when short"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: need - avail → need + avail": (
        "performance only: a larger read, same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: max(need, self.block_bytes) → min(need, self.block_bytes)": (
        "performance only: smaller reads, same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: avail < need → avail <= need": (
        "performance only: one read more, same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: want -= len(chunk) → pass": (
        "performance only: larger reads, same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader.fill: want -= len(chunk) → want += len(chunk)": (
        "performance only: larger reads, same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader._check_fits: start + padded > MAX_OFFSET → start + padded >= MAX_OFFSET": (
        "offsets and padded sizes are multiples of 512, MAX_OFFSET (2**63 - 1) is odd"
    ),
    "cloudshards/tar/blocks.py:BlockReader._in_member: exc.member is not None or (member is None and entry is None) → exc.member is not None and (member is None and entry is None)": (
        "gzip errors never name a member, and every caller passes a member or an entry"
    ),
    "cloudshards/tar/blocks.py:BlockReader._in_member: return exc → pass": (
        "unreachable: gzip errors never name a member, every caller names a member or entry"
    ),
    "cloudshards/tar/blocks.py:BlockReader._in_member: self.base + self.pos → self.base - self.pos": (
        "unreachable: gzip errors always carry an offset"
    ),
    "cloudshards/tar/blocks.py:BlockReader.skip: size <= avail → size < avail": (
        "skipping exactly the rest of the buffer through the other path: same position"
    ),
    "cloudshards/tar/blocks.py:BlockReader.skip: size > self.block_bytes → size >= self.block_bytes": (
        "performance only: one block skipped by seeking instead of reading"
    ),
    "cloudshards/tar/blocks.py:BlockReader._take: size <= avail → size < avail": (
        "exactly the rest of the buffer through fill() or the large path: same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader._take: size <= self.block_bytes → size < self.block_bytes": (
        "a member of exactly block_bytes through the large path: same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader._take: return None → pass": (
        "then pos + size is past the buffer: the padding skip after it fails at EOF, same error"
    ),
    "cloudshards/tar/blocks.py:BlockReader._read_exact: return chunk → pass": (
        "the loop after it joins the same single chunk"
    ),
    "cloudshards/tar/blocks.py:BlockReader._ends_within: self.read(1) → self.read(2)": (
        "it seeks back over what it read, however much"
    ),
    "cloudshards/tar/blocks.py:BlockReader._read_chunks: self.read(min(size, self.block_bytes)) → self.read(max(size, self.block_bytes))": (
        "performance only: the member in one read, same bytes"
    ),
    "cloudshards/tar/blocks.py:BlockReader._seek: self.seekable = None → pass": (
        "performance only: a seek that failed is tried again, then the bytes are read"
    ),
    "cloudshards/tar/blocks.py:BlockReader.finish_at_eof: self.base + self.pos → self.base - self.pos": (
        "pos is 0 here: it runs after a failed fill(), which rebases the buffer"
    ),
    "cloudshards/cache/membertable.py:table_samples: zip(table.names, table.keys, table.fields, table.offsets, table.sizes, strict=True) → zip(table.names, table.keys, table.fields, table.offsets, table.sizes, strict=False)": (
        "a loaded table's columns have one entry per row: load_table checks every count"
    ),
    "cloudshards/cache/membertable.py:table_samples: max(table.sizes) > max_member_bytes → max(table.sizes) >= max_member_bytes": (
        "at equality the member reader's path runs instead, and gives the same samples (it refuses only members past the limit)"
    ),
    "cloudshards/cache/membertable.py:MemberTable.rows: zip(self.names, self.offsets, self.sizes, strict=True) → zip(self.names, self.offsets, self.sizes, strict=False)": (
        "the columns have one length: appended together, or checked by load_table"
    ),
    # --- cache ------------------------------------------------------------------------------
    "cloudshards/cache/budget.py:CacheBudget._reserve: os.ftruncate(lock.fd, 0) → os.ftruncate(lock.fd, 1)": (
        "the record written next is at least one character, and starts at byte 0"
    ),
    "cloudshards/cache/budget.py:CacheBudget._reserve: size or 0 → size or 1": (
        "a record is summed only while its download holds the lock under a budget, where an unknown size is refused before any download"
    ),
    'cloudshards/cache/facts.py:_store_key: urlsplit(url).netloc.rsplit("@", 1) → urlsplit(url).netloc.rsplit("@", 2)': (
        "any maxsplit of at least 1 gives the same last part"
    ),
    "cloudshards/cache/follow.py:FollowStream.read_view: time.sleep(delay) → pass": (
        "polling only: busy-waits instead (CPU, not behaviour)"
    ),
    "cloudshards/cache/follow.py:FollowStream.read_view: min(delay * 2, self.POLL_MAX_S) → max(delay * 2, self.POLL_MAX_S)": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.read_view: delay * 2 → delay // 2": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.read_view: delay * 2 → delay * 3": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.read_view: delay * 2 → delay * 1": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: self.fd < 0 → self.fd <= 0": (
        "descriptor 0 is standard input, never a partial file's"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: self.fd < 0 → self.fd < 1": (
        "descriptor 0 is standard input, never a partial file's"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: time.monotonic() > deadline → time.monotonic() >= deadline": (
        "equal monotonic readings: a boundary of no width"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: break → pass": (
        "the loop condition is false right after (the entry is committed)"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: time.sleep(delay) → pass": (
        "polling only: busy-waits instead (CPU, not behaviour)"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: min(delay * 2, self.POLL_MAX_S) → max(delay * 2, self.POLL_MAX_S)": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: delay * 2 → delay // 2": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: delay * 2 → delay * 3": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.save_member_table: delay * 2 → delay * 1": (
        "polling interval only"
    ),
    "cloudshards/cache/follow.py:FollowStream.close: self.fd >= 0 → self.fd > 0": (
        "descriptor 0 is standard input, never a partial file's"
    ),
    "cloudshards/cache/follow.py:FollowStream.close: self.fd >= 0 → self.fd >= 1": (
        "descriptor 0 is standard input, never a partial file's"
    ),
    "cloudshards/cache/follow.py:FollowStream.close: -1 → -2": (
        "any negative descriptor means closed"
    ),
    "cloudshards/cache/follow.py:FollowStream.close: -1 → -0": (
        "after close nothing reads the descriptor: read and save_member_table are not called on a closed stream, and a second close returns first"
    ),
    "cloudshards/cache/lock.py:DownloadLock.__init__: -1 → -2": (
        "any negative descriptor means not held"
    ),
    "cloudshards/cache/lock.py:DownloadLock.release: self.fd >= 0 → self.fd > 0": (
        "descriptor 0 is standard input, never a lock file's"
    ),
    "cloudshards/cache/lock.py:DownloadLock.release: self.fd >= 0 → self.fd >= 1": (
        "descriptor 0 is standard input, never a lock file's"
    ),
    "cloudshards/cache/lock.py:DownloadLock.release: fcntl.flock(self.fd, fcntl.LOCK_UN) → pass": (
        "closing the only descriptor of the lock's open file releases its flock"
    ),
    "cloudshards/cache/lock.py:DownloadLock.release: -1 → -2": (
        "any negative descriptor means not held"
    ),
    "cloudshards/cache/facts.py:Checksum.hasher: hashlib.md5(usedforsecurity=False) → hashlib.md5(usedforsecurity=True)": (
        "the flag only matters to FIPS builds of OpenSSL; the digest is the same"
    ),
    "cloudshards/cache/shardcache.py:ShardCache._open_hit: fcntl.flock(fd, fcntl.LOCK_SH); info = os.fstat(fd) → info = os.fstat(fd); fcntl.flock(fd, fcntl.LOCK_SH)": (
        "a committed entry is never rewritten in place: its size and inode are the same before and after the shared lock"
    ),
    "cloudshards/cache/tee.py:TeeStream.read_view: size < 0 → size <= 0": (
        "a size of 0 returned b'' just above"
    ),
    "cloudshards/cache/tee.py:TeeStream.read_view: size < 0 → size < 1": (
        "a size of 0 returned b'' just above"
    ),
    "cloudshards/cache/tee.py:TeeStream.read_view: continue → pass": (
        "data is empty there, so the loop goes round all the same"
    ),
    "cloudshards/cache/tee.py:TeeStream._take: cut >= len(data) → cut > len(data)": (
        "at equality the held part is empty and the prefix digest is taken at the same byte"
    ),
    "cloudshards/cache/tee.py:TeeStream._take: self._digest.update(data); self._write(data) → self._write(data); self._digest.update(data)": (
        "independent: the digest and the file get the same bytes"
    ),
    "cloudshards/cache/tee.py:TeeStream._take: self._digest.update(back); self._write(front) → self._write(front); self._digest.update(back)": (
        "independent: the digest and the file get the same bytes"
    ),
    "cloudshards/cache/tee.py:TeeStream._take: self._write(front); self._held += back → self._held += back; self._write(front)": (
        "independent: a failed write merges the held bytes just after either way"
    ),
    "cloudshards/cache/tee.py:TeeStream._take: self._held.clear() → pass": (
        "memory only: nothing reads the held buffer once verification is off (disk full)"
    ),
    "cloudshards/cache/tee.py:TeeStream._write: warn_disk_full(self.stats, exc); self._drop_partial() → self._drop_partial(); warn_disk_full(self.stats, exc)": (
        "independent: a warning and giving the file up"
    ),
    "cloudshards/cache/tee.py:TeeStream._fail: self._drop_partial(poison=True); self._error = ShardOpenError(f'cache: {reason}', url=self.url, offset=self._received) → self._error = ShardOpenError(f'cache: {reason}', url=self.url, offset=self._received); self._drop_partial(poison=True)": (
        "independent: the error is raised after both"
    ),
    "cloudshards/cache/recheck.py:recheck_download: stats.bytes_network += len(chunk); whole.update(chunk) → whole.update(chunk); stats.bytes_network += len(chunk)": (
        "independent"
    ),
    "cloudshards/cache/recheck.py:recheck_download: whole.update(chunk); cut = max(0, min(len(chunk), served - position)) → cut = max(0, min(len(chunk), served - position)); whole.update(chunk)": (
        "independent"
    ),
    "cloudshards/cache/recheck.py:recheck_download: second_prefix.update(chunk[:cut]); tail += chunk[cut:] → tail += chunk[cut:]; second_prefix.update(chunk[:cut])": (
        "independent"
    ),
    "cloudshards/cache/recheck.py:recheck_download: size or 0 → size or 1": (
        "a recheck needs a size (the held-back end is computed from it): for an empty object a longer second download is 'changed' either way"
    ),
    'cloudshards/cache/recheck.py:recheck_download: return "changed", b"" → pass #2': (
        "a second download of another length matches neither digest (the first download had the expected length), so it is 'changed' below"
    ),
    "cloudshards/cache/tee.py:TeeStream._complete: self._held.clear() → pass": (
        "memory only: the held bytes were copied into the tail being served"
    ),
    "cloudshards/cache/tee.py:TeeStream._complete: self._held.clear(); self._tail = memoryview(tail) → self._tail = memoryview(tail); self._held.clear()": (
        "independent: tail is a copy"
    ),
    "cloudshards/cache/tee.py:TeeStream._complete: self._abandon(); self._not_kept(exc) → self._not_kept(exc); self._abandon()": (
        "independent: a warning and giving the file up"
    ),
    "cloudshards/cache/tee.py:TeeStream._drain: return → pass #2": (
        "after the end the entry is complete (no descriptor: the loop ends) or the check raised"
    ),
    "cloudshards/cache/shardcache.py:ShardCache._download.commit: self._write_meta(name, {**meta, 'size': nbytes}); table = tee.tables.take() if tee is not None else None → table = tee.tables.take() if tee is not None else None; self._write_meta(name, {**meta, 'size': nbytes})": (
        "_write_meta and write_table write a temporary file and rename it: failing, they leave nothing behind, so when its path joins the clean-up list does not matter"
    ),
    "cloudshards/cache/shardcache.py:ShardCache._download.commit: written.append(self._path('meta', name + '.json')); self._write_meta(name, {**meta, 'size': nbytes}) → self._write_meta(name, {**meta, 'size': nbytes}); written.append(self._path('meta', name + '.json'))": (
        "_write_meta and write_table write a temporary file and rename it: failing, they leave nothing behind, so when its path joins the clean-up list does not matter"
    ),
    "cloudshards/cache/shardcache.py:ShardCache._download.commit: written.append(self._table_path(name)); write_table(self._table_path(name), table, nbytes) → write_table(self._table_path(name), table, nbytes); written.append(self._table_path(name))": (
        "_write_meta and write_table write a temporary file and rename it: failing, they leave nothing behind, so when its path joins the clean-up list does not matter"
    ),
    "cloudshards/cache/follow.py:FollowStream._pread: size > 0 → size >= 0": (
        "read_view(0) returns before: size is never 0 here"
    ),
    'cloudshards/cache/facts.py:remote_facts: getattr(stream, "size", None) or getattr(raw, "size", None) → getattr(stream, "size", None) and getattr(raw, "size", None)': (
        "a stream's size is also in the details it carries, which are read next when it is None"
    ),
    # --- balance ------------------------------------------------------------------------------
    "cloudshards/balance.py:_url_key: hashlib.blake2b(key.encode(), digest_size=16) → hashlib.blake2b(key.encode(), digest_size=17)": (
        "the key only names entries that this version writes and reads"
    ),
    "cloudshards/balance.py:_url_key: hashlib.blake2b(key.encode(), digest_size=16) → hashlib.blake2b(key.encode(), digest_size=15)": (
        "the key only names entries that this version writes and reads"
    ),
    "cloudshards/balance.py:resolve_sample_counts: zip(keys, found, strict=True) → zip(keys, found, strict=False)": (
        "_from_index returns one count per URL, by construction"
    ),
    "cloudshards/balance.py:resolve_sample_counts: zip(keys, result, strict=True) → zip(keys, result, strict=False)": (
        "pool.map returns one count per URL"
    ),
    "cloudshards/balance.py:assign_samples: position >= end → position > end": (
        "the break only ends the loop early: every later shard has lo >= end >= hi"
    ),
    "cloudshards/balance.py:assign_samples: break → pass": (
        "the break only ends the loop early: every later shard has lo >= end >= hi"
    ),
    # --- redaction ----------------------------------------------------------------------------
    'cloudshards/redact.py:redact_url: rest.rindex("@") + 1 → rest.rindex("@") + 0': (
        "the kept '@' makes urlsplit see empty user info, which the next branch masks alike"
    ),
    "cloudshards/redact.py:redact_record: record.exc_info[1] → record.exc_info[0]": (
        "logging normalizes exc_info: the type is None exactly when the value is"
    ),
    'cloudshards/redact.py:_is_backend: name.split(".", 1) → name.split(".", 2)': (
        "maxsplit does not change the first part"
    ),
    "cloudshards/redact.py:install_log_redaction: return → pass": (
        "the early return only skips work that the _installed check makes a no-op"
    ),
    "cloudshards/redact.py:install_log_redaction: _installed.add(name) → pass": (
        "Logger.addFilter ignores a filter it already has"
    ),
}


# --- generating mutants -------------------------------------------------------------------------

#: Operator swaps: the operator's text (a regex, found between the operands) and its swap.
_COMPARE_SWAP: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Is: (r"\bis\b", "is not"),
    ast.IsNot: (r"\bis\s+not\b", "is"),
    ast.In: (r"\bin\b", "not in"),
    ast.NotIn: (r"\bnot\s+in\b", "in"),
}
_BINOP_SWAP: dict[type[ast.operator], tuple[str, str]] = {
    ast.Add: (r"\+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: (r"\*", "//"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
}
#: Calls that are never removed or moved: logging, and the cache's test checkpoints.
_QUIET_CALLS = ("logger.", "logging.", "_checkpoint", "_cachelock._checkpoint")


@dataclasses.dataclass(frozen=True)
class Mutant:
    area: str
    path: str
    qualname: str
    line: int
    start: tuple[int, int]  # (line, byte column) of the replaced span
    end: tuple[int, int]
    replacement: str
    original: str  # the replaced source, on one line
    mutated: str
    lines: tuple[int, ...]  # lines whose tests may catch it
    occurrence: int = 0

    @property
    def key(self) -> str:
        """Stable across edits elsewhere in the file: path, function, text before and after."""
        suffix = f" #{self.occurrence + 1}" if self.occurrence else ""
        return f"{self.path}:{self.qualname}: {self.original} → {self.mutated}{suffix}"

    @property
    def shown(self) -> str:
        return f"{self.path}:{self.line} ({self.qualname}) {_cut(self.original)} → {_cut(self.mutated)}"


def _cut(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return ast.unparse(node.func)
    return ""


def _is_quiet(node: ast.AST) -> bool:
    name = _call_name(node)
    return any(name.startswith(prefix) or name == prefix for prefix in _QUIET_CALLS)


def _names(node: ast.AST, ctx: type[ast.expr_context]) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


class _Generator:
    """Walks one module; collects mutants of the targeted functions."""

    def __init__(
        self, area: str, path: str, source: str, patterns: Sequence[str], swap: Sequence[str]
    ):
        self.area = area
        self.path = path
        self.source = source
        self.lines = source.encode().splitlines(keepends=True)
        self.patterns = patterns
        self.swap_patterns = swap
        self.mutants: list[Mutant] = []
        self._seen: dict[tuple[str, str, str], int] = {}

    # spans ----------------------------------------------------------------------------------

    def _segment(self, start: tuple[int, int], end: tuple[int, int]) -> str:
        data = b"".join(self.lines)
        return data[self._offset(*start) : self._offset(*end)].decode()

    def _offset(self, line: int, col: int) -> int:
        return sum(len(chunk) for chunk in self.lines[: line - 1]) + col

    def _add(
        self,
        qualname: str,
        node: ast.AST,
        replacement: str,
        *,
        start: tuple[int, int] | None = None,
        end: tuple[int, int] | None = None,
        shown: str | None = None,
        original: str | None = None,
    ) -> None:
        start = start or (node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = end or (node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        before = _one_line(original if original is not None else self._segment(start, end))
        after = _one_line(shown if shown is not None else replacement)
        if before == after:
            return
        seen = (qualname, before, after)
        occurrence = self._seen.get(seen, 0)
        self._seen[seen] = occurrence + 1
        self.mutants.append(
            Mutant(
                area=self.area,
                path=self.path,
                qualname=qualname,
                line=start[0],
                start=start,
                end=end,
                replacement=replacement,
                original=before,
                mutated=after,
                lines=tuple(range(start[0], end[0] + 1)),
                occurrence=occurrence,
            )
        )

    def _text(self, node: ast.AST) -> str:
        return self._segment(
            (node.lineno, node.col_offset),  # type: ignore[attr-defined]
            (node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def _negate(self, qualname: str, test: ast.expr) -> None:
        if not _negation_is_duplicate(test):
            text = f"not ({self._text(test)})"
            self._add(qualname, test, f"({text})", shown=text)

    def _swap_operator(
        self,
        qualname: str,
        node: ast.AST,
        operands: Sequence[ast.AST],
        index: int,
        old: str,
        new: str,
    ) -> None:
        """Replace the operator between ``operands[index]`` and ``operands[index + 1]`` (found
        in the source text between them: ``old`` is a regex) by ``new``; the rest of the
        expression keeps its text."""
        node_start = self._offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        left, right = operands[index], operands[index + 1]
        a = self._offset(left.end_lineno, left.end_col_offset) - node_start  # type: ignore[attr-defined]
        b = self._offset(right.lineno, right.col_offset) - node_start  # type: ignore[attr-defined]
        raw = self._text(node).encode()
        gap = raw[a:b].decode()
        replaced, count = re.subn(old, new, gap, count=1)
        if not count:
            return
        text = (raw[:a] + replaced.encode() + raw[b:]).decode()
        self._add(qualname, node, f"({text})", shown=text)

    # walking --------------------------------------------------------------------------------

    def run(self) -> list[Mutant]:
        tree = ast.parse(self.source)
        self._scope(tree.body, "", targeted=False, swapping=False)
        return self.mutants

    def _matches(self, qualname: str, patterns: Sequence[str]) -> bool:
        return any(fnmatch.fnmatchcase(qualname, p) for p in patterns)

    def _scope(self, body: list[ast.stmt], prefix: str, *, targeted: bool, swapping: bool) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = prefix + stmt.name
                hit = targeted or self._matches(qualname, self.patterns)
                swap = swapping or self._matches(qualname, self.swap_patterns)
                if hit:
                    self._body(stmt.body, qualname, swap)
                else:  # nested functions of an untargeted function may still be named
                    self._scope(stmt.body, qualname + ".", targeted=False, swapping=False)
            elif isinstance(stmt, ast.ClassDef):
                self._scope(
                    stmt.body, prefix + stmt.name + ".", targeted=targeted, swapping=swapping
                )

    def _body(
        self, body: list[ast.stmt], qualname: str, swap: bool, *, in_if: bool = False
    ) -> None:
        """Mutate a block's statements; ``in_if``: the block of an ``if`` (an early ``return``
        there is removable)."""
        for index, stmt in enumerate(body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                self._body(stmt.body, f"{qualname}.{stmt.name}", swap)
                continue
            if isinstance(stmt, ast.ClassDef) or (index == 0 and _is_docstring(stmt)):
                continue
            if in_if and isinstance(stmt, ast.Return):
                self._add(qualname, stmt, "pass")
            self._statement(stmt, qualname)
            if swap and index + 1 < len(body):
                self._swap(stmt, body[index + 1], qualname)
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if inner:
                    self._body(inner, qualname, swap, in_if=isinstance(stmt, ast.If))
            for handler in getattr(stmt, "handlers", ()):
                self._body(handler.body, qualname, swap)
            for case in getattr(stmt, "cases", ()):
                self._body(case.body, qualname, swap, in_if=True)

    def _statement(self, stmt: ast.stmt, qualname: str) -> None:
        # Removed statements.
        if isinstance(stmt, ast.Raise | ast.Continue | ast.Break):
            self._add(qualname, stmt, "pass")
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            if not _is_quiet(stmt.value):
                self._add(qualname, stmt, "pass")
        elif isinstance(stmt, ast.AugAssign) or (
            isinstance(stmt, ast.Assign)
            and all(isinstance(t, ast.Attribute | ast.Subscript) for t in stmt.targets)
        ):
            self._add(qualname, stmt, "pass")  # a counter, or state kept on an object
        # Negated conditions.
        if isinstance(stmt, ast.If | ast.While):
            self._negate(qualname, stmt.test)
        # Augmented assignment operators.
        if isinstance(stmt, ast.AugAssign) and type(stmt.op) in (ast.Add, ast.Sub):
            old, new = (r"\+=", "-=") if isinstance(stmt.op, ast.Add) else ("-=", "+=")
            text = self._text(stmt)
            self._add(qualname, stmt, re.sub(old, new, text, count=1))
        # Expressions of this statement (not of nested blocks, not of nested functions).
        for expr in _own_expressions(stmt):
            self._expressions(expr, qualname)

    def _expressions(self, root: ast.expr, qualname: str) -> None:
        parents: dict[ast.AST, ast.AST] = {}
        for node, parent in _walk_with_parent(root):
            if parent is not None:
                parents[node] = parent
            if isinstance(node, ast.JoinedStr) or _is_quiet(node):
                continue  # (children are skipped by _walk_with_parent)
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for i, op in enumerate(node.ops):
                    if type(op) in _COMPARE_SWAP:
                        old, new = _COMPARE_SWAP[type(op)]
                        self._swap_operator(qualname, node, operands, i, old, new)
            elif isinstance(node, ast.BinOp):
                if type(node.op) in _BINOP_SWAP and not _stringy(node):
                    old, new = _BINOP_SWAP[type(node.op)]
                    self._swap_operator(qualname, node, [node.left, node.right], 0, old, new)
            elif isinstance(node, ast.BoolOp):
                old, new = (
                    (r"\band\b", "or") if isinstance(node.op, ast.And) else (r"\bor\b", "and")
                )
                node_start = self._offset(node.lineno, node.col_offset)
                raw = self._text(node).encode()
                pieces, cursor = [], 0
                for left, right in zip(node.values, node.values[1:], strict=False):
                    a = self._offset(left.end_lineno, left.end_col_offset) - node_start  # type: ignore[arg-type]
                    b = self._offset(right.lineno, right.col_offset) - node_start
                    pieces += [raw[cursor:a], re.sub(old, new, raw[a:b].decode(), count=1).encode()]
                    cursor = b
                text = (b"".join(pieces) + raw[cursor:]).decode()
                self._add(qualname, node, f"({text})", shown=text)
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                text = self._text(node.operand)
                self._add(qualname, node, f"({text})", shown=text)
            elif isinstance(node, ast.IfExp):
                self._negate(qualname, node.test)
            elif isinstance(node, ast.comprehension):
                for cond in node.ifs:
                    self._negate(qualname, cond)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("min", "max"):
                    other = "max" if node.func.id == "min" else "min"
                    self._in_context(qualname, node.func, other, node, parents)
            elif isinstance(node, ast.Constant):
                if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.LShift | ast.RShift):
                    continue  # buffer sizes such as 1 << 22
                if isinstance(node.value, bool):
                    self._in_context(qualname, node, repr(not node.value), node, parents)
                elif isinstance(node.value, int):
                    for value in (node.value + 1, node.value - 1):
                        if value >= 0 or node.value < 0:
                            self._in_context(qualname, node, str(value), node, parents)

    def _in_context(
        self,
        qualname: str,
        node: ast.AST,
        replacement: str,
        inner: ast.AST,
        parents: dict[ast.AST, ast.AST],
    ) -> None:
        """Replace ``node`` only, but name the mutant by the smallest one-line expression around
        it (``split("://", 1) → split("://", 2)``, not ``1 → 2``)."""
        context: ast.AST = inner
        while context in parents and not (
            isinstance(context, ast.expr) and context is not node and context is not inner
        ):
            context = parents[context]
        if isinstance(context, ast.expr) and context.lineno == context.end_lineno:
            text = self._segment(
                (context.lineno, context.col_offset), (context.end_lineno, context.end_col_offset)
            )
            if len(text) <= 100:
                raw = text.encode()
                a = self._offset(node.lineno, node.col_offset) - self._offset(
                    context.lineno, context.col_offset
                )  # type: ignore[attr-defined]
                b = self._offset(node.end_lineno, node.end_col_offset) - self._offset(
                    context.lineno, context.col_offset
                )  # type: ignore[attr-defined]
                shown = (raw[:a] + replacement.encode() + raw[b:]).decode()
                self._add(qualname, node, replacement, original=text, shown=shown)
                return
        self._add(qualname, node, replacement)

    def _swap(self, first: ast.stmt, second: ast.stmt, qualname: str) -> None:
        simple = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)
        if not (isinstance(first, simple) and isinstance(second, simple)):
            return
        if any(_is_docstring(s) for s in (first, second)):
            return
        if any(isinstance(s, ast.Expr) and _is_quiet(s.value) for s in (first, second)):
            return
        if not any(isinstance(s, ast.Expr) for s in (first, second)):
            return  # two assignments: order is what their names say (checked below) or moot
        written_first = _names(first, ast.Store)
        written_second = _names(second, ast.Store)
        if written_first & _names(second, ast.Load) or written_second & _names(first, ast.Load):
            return  # a data dependency: the swap would only raise NameError or read a stale value
        if first.end_lineno is None or second.end_lineno is None:
            return
        if first.end_lineno >= second.lineno:
            return
        for stmt in (first, second):
            line = self.lines[stmt.lineno - 1]
            if line[: stmt.col_offset].strip():
                return
        chunk_a = b"".join(self.lines[first.lineno - 1 : second.lineno - 1]).decode()
        chunk_b = b"".join(self.lines[second.lineno - 1 : second.end_lineno]).decode()
        self._add(
            qualname,
            first,
            chunk_b + chunk_a,
            start=(first.lineno, 0),
            end=(second.end_lineno + 1, 0),
            original=f"{ast.unparse(first)}; {ast.unparse(second)}",
            shown=f"{ast.unparse(second)}; {ast.unparse(first)}",
        )


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _negation_is_duplicate(test: ast.expr) -> bool:
    """``not`` removed, ``==`` / ``is`` / ``in`` swapped, or a constant flipped: the same mutant."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.Constant):
        return True
    return (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq | ast.NotEq | ast.Is | ast.IsNot | ast.In | ast.NotIn)
    )


def _stringy(node: ast.BinOp) -> bool:
    """``"a" + b``, f-strings, ``"%s" % x``: a swap there only raises TypeError."""
    return any(
        isinstance(side, ast.JoinedStr)
        or (isinstance(side, ast.Constant) and isinstance(side.value, str | bytes))
        or (isinstance(side, ast.BinOp) and _stringy(side))
        for side in (node.left, node.right)
    )


def _own_expressions(stmt: ast.stmt) -> Iterator[ast.expr]:
    """The expressions of ``stmt`` itself, not those of the blocks it holds."""
    for field, value in ast.iter_fields(stmt):
        if field in ("body", "orelse", "finalbody", "handlers", "cases", "decorator_list"):
            continue
        if field in ("annotation", "returns", "type_comment"):
            continue
        if isinstance(value, ast.expr):
            yield value
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, ast.expr):
                    yield item
                elif isinstance(item, ast.withitem):
                    yield item.context_expr
    if isinstance(stmt, ast.Try | ast.TryStar):
        for handler in stmt.handlers:
            if handler.type is not None:
                yield handler.type


def _walk_with_parent(root: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """Nodes under ``root`` with their parents; skips the insides of f-strings, logging calls
    and lambdas' defaults (nothing else is skipped)."""
    stack: list[tuple[ast.AST, ast.AST | None]] = [(root, None)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        if isinstance(node, ast.JoinedStr) or _is_quiet(node):
            continue
        children = list(ast.iter_child_nodes(node))
        for child in reversed(children):
            if isinstance(
                child, ast.expr_context | ast.operator | ast.cmpop | ast.boolop | ast.unaryop
            ):
                continue
            if isinstance(child, ast.arguments):
                continue
            stack.append((child, node))


# The mutated files as they were when their mutants were made: the copies get these texts and
# every mutant is applied to them, so edits to the checkout during a run change nothing.
SNAPSHOT: dict[str, str] = {}


def generate(areas: Sequence[str]) -> list[Mutant]:
    mutants: list[Mutant] = []
    for name in areas:
        area = AREAS[name]
        for path, patterns in area.targets.items():
            source = SNAPSHOT.setdefault(path, (REPO / path).read_text())
            mutants += _Generator(name, path, source, patterns, area.swap).run()
    return mutants


def apply(source: str, mutant: Mutant) -> str:
    data = source.encode()
    lines = data.splitlines(keepends=True)

    def offset(line: int, col: int) -> int:
        return sum(len(chunk) for chunk in lines[: line - 1]) + col

    start, end = offset(*mutant.start), offset(*mutant.end)
    return (data[:start] + mutant.replacement.encode() + data[end:]).decode()


# --- running --------------------------------------------------------------------------------

_COVERAGE_PLUGIN = '''\
"""Written by integration/mutation.py: one coverage context per test (its node id), and each
test's duration (in MUTATION_DURATIONS)."""
import json
import os
import time

import coverage
import pytest

DURATIONS = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)
        # A process the test forks restarts coverage from this configuration (patch = fork):
        # its static context names the test too.
        cov.config.context = item.nodeid
    started = time.perf_counter()
    yield
    DURATIONS[item.nodeid] = time.perf_counter() - started
    if cov is not None:
        cov.switch_context("")
        cov.config.context = None


def pytest_sessionfinish(session):
    with open(os.environ["MUTATION_DURATIONS"], "w") as handle:
        json.dump(DURATIONS, handle)
'''


def copy_tree(destination: Path) -> None:
    """Tracked and untracked (not ignored) files of the working tree, as they are now."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        relative = raw.decode()
        source = REPO / relative
        if not source.is_file() or source.is_symlink():
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    for relative, text in SNAPSHOT.items():
        (destination / relative).write_text(text)
    (destination / "_mutation_coverage_ctx.py").write_text(_COVERAGE_PLUGIN)
    # Measure the processes the tests fork too (the cache's tests fork ranks).
    (destination / ".mutation-coveragerc").write_text(
        "[run]\nparallel = true\npatch =\n    fork\n    _exit\n"
    )


def child_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant and the original may share size and mtime
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def pytest_args(tests: Sequence[str], timeout_s: float) -> list[str]:
    return ["-p", "no:cacheprovider", "-x", "-q", f"--timeout={timeout_s:g}", *tests]


@dataclasses.dataclass
class TestMap:
    """Which test runs which line (per target file), and how long each test takes."""

    lines: dict[str, dict[int, set[str]]] = dataclasses.field(default_factory=dict)
    durations: dict[str, float] = dataclasses.field(default_factory=dict)

    def covering(self, mutant: Mutant) -> list[str]:
        """The tests that run the mutated lines, fastest first."""
        by_line = self.lines.get(mutant.path, {})
        tests: set[str] = set()
        for line in mutant.lines:
            tests |= by_line.get(line, set())
        return sorted(tests, key=lambda t: (self.durations.get(t, 0.0), t))


def baseline(tree: Path, name: str, area: Area, timeout_s: float, into: TestMap) -> float:
    """Run the area's tests on the unmutated copy under coverage, one context per test."""
    data_file = tree / f".coverage-{name}"
    durations = tree / f".durations-{name}.json"
    include = ",".join(str(tree / path) for path in area.targets)
    command = [
        sys.executable,
        "-m",
        "coverage",
        "run",
        f"--rcfile={tree / '.mutation-coveragerc'}",
        f"--data-file={data_file}",
        f"--include={include}",
        "-m",
        "pytest",
        "-p",
        "_mutation_coverage_ctx",
        *pytest_args(area.tests, timeout_s),
    ]
    env = child_env(tree)
    env["MUTATION_DURATIONS"] = str(durations)
    started = time.monotonic()
    run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if run.returncode != 0:
        sys.stdout.write(run.stdout[-6000:] + run.stderr[-3000:])
        raise SystemExit(f"the {name} tests fail without any mutant: fix them first")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "coverage",
            "combine",
            "--quiet",
            f"--rcfile={tree / '.mutation-coveragerc'}",
            f"--data-file={data_file}",
        ],
        cwd=tree,
        env=env,
        check=True,
    )
    import coverage  # only the baseline needs it

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    for path in area.targets:
        contexts = data.contexts_by_lineno(str(tree / path))
        into.lines[path] = {line: {c for c in ctxs if c} for line, ctxs in contexts.items()}
    into.durations.update(json.loads(durations.read_text()))
    return elapsed


@dataclasses.dataclass
class Result:
    mutant: Mutant
    verdict: str  # caught, survived, timeout, error
    seconds: float
    stage: str  # "covering" (the tests that run its lines) or "all" (the area's test files)
    detail: str = ""


@dataclasses.dataclass
class _Job:
    mutant: Mutant
    slot: int
    stage: str
    tests: list[str]
    started: float
    pid: int
    log: Path
    spent: float = 0.0


class Runner:
    """Runs mutants on ``jobs`` copies of the tree, one mutant per copy at a time."""

    def __init__(
        self,
        trees: list[Path],
        isolation: str,
        timeout_s: float,
        hard_limit_s: float,
        *,
        confirm: bool = False,
    ):
        self.trees = trees
        self.confirm = confirm
        self.isolation = isolation
        self.timeout_s = timeout_s
        self.hard_limit_s = hard_limit_s
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.running: dict[int, _Job] = {}

    def stop(self) -> None:
        """Kill the test runs still going (and what they started)."""
        for pid in list(self.running):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                self._wait(pid, block=True)
        self.running.clear()

    def _start(self, slot: int, mutant: Mutant, tests: list[str], stage: str) -> _Job:
        tree = self.trees[slot]
        shutil.rmtree(tree / ".hypothesis", ignore_errors=True)
        log = tree / f".mutant-{slot}.log"
        args = pytest_args(tests, self.timeout_s)
        if self.isolation == "fork":
            pid = os.fork()
            if pid == 0:  # the child: never returns
                _run_pytest_in_child(tree, args, log)
        else:
            with open(log, "wb") as handle:
                process = subprocess.Popen(
                    [sys.executable, "-m", "pytest", *args],
                    cwd=tree,
                    env=child_env(tree),
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            pid = process.pid
            self.processes[pid] = process
        return _Job(mutant, slot, stage, tests, time.monotonic(), pid, log)

    def _install(self, slot: int, mutant: Mutant | None, path: str) -> None:
        original = SNAPSHOT[path]
        text = original if mutant is None else apply(original, mutant)
        (self.trees[slot] / path).write_text(text)

    def run(
        self,
        mutants: Sequence[Mutant],
        tests: TestMap,
        all_tests: dict[str, tuple[str, ...]],
        report: Callable[[Result, int, int], None],
    ) -> list[Result]:
        pending = list(mutants)
        free = list(range(len(self.trees)))
        running = self.running
        results: list[Result] = []
        while pending or running:
            while free and pending:
                mutant = pending.pop(0)
                slot = free.pop(0)
                self._install(slot, mutant, mutant.path)
                selected = tests.covering(mutant)
                stage = "covering"
                if not selected:
                    selected, stage = list(all_tests[mutant.area]), "all"
                job = self._start(slot, mutant, selected, stage)
                running[job.pid] = job
            finished = self._reap(running)
            for job, code, timed_out in finished:
                elapsed = time.monotonic() - job.started + job.spent
                text = job.log.read_text(errors="replace") if job.log.exists() else ""
                tail = text[-4000:]
                hung = timed_out or "+ Timeout +" in text or "Failed: Timeout" in text
                verdict = _verdict(code)
                if hung:
                    verdict = "timeout"
                confirm = self.confirm or verdict == "error"
                if verdict in ("survived", "error") and job.stage == "covering" and confirm:
                    # Not caught by the tests that run its lines: try all of the area's tests.
                    again = self._start(
                        job.slot, job.mutant, list(all_tests[job.mutant.area]), "all"
                    )
                    again.spent = elapsed
                    running[again.pid] = again
                    continue
                result = Result(
                    job.mutant, verdict, elapsed, job.stage, _detail(verdict, code, tail)
                )
                results.append(result)
                report(result, len(results), len(mutants))
                self._install(job.slot, None, job.mutant.path)
                free.append(job.slot)
            if not finished:
                time.sleep(0.02)
        return results

    def _reap(self, running: dict[int, _Job]) -> list[tuple[_Job, int, bool]]:
        done: list[tuple[_Job, int, bool]] = []
        for pid, job in list(running.items()):
            if time.monotonic() - job.started > self.hard_limit_s:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                self._wait(pid, block=True)
                del running[pid]
                done.append((job, -9, True))
                continue
            code = self._wait(pid, block=False)
            if code is None:
                continue
            del running[pid]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # leftovers of the test run (forked ranks)
            done.append((job, code, False))
        return done

    def _wait(self, pid: int, *, block: bool) -> int | None:
        process = self.processes.get(pid)
        if process is not None:
            code = process.wait() if block else process.poll()
            if code is not None:
                del self.processes[pid]
            return code
        waited, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if waited else None


def _run_pytest_in_child(tree: Path, args: list[str], log: Path) -> None:
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(tree)
        os.environ.update(child_env(tree))
        sys.dont_write_bytecode = True
        sys.path[0] = str(tree)  # instead of this script's folder
        import pytest

        code = int(pytest.main(args))
        import cloudshards

        if not str(Path(cloudshards.__file__).resolve()).startswith(str(tree.resolve())):
            print(f"cloudshards was imported from {cloudshards.__file__}, not the copy")
            code = 99
    except BaseException as exc:  # report anything: never return to the parent's loop
        print(f"mutation runner child failed: {exc!r}")
        code = 98
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _verdict(code: int) -> str:
    # pytest: 0 all passed, 1 a test failed, 2 interrupted (collection error), 3 internal error,
    # 4 usage error (a test id not found), 5 no tests collected; negative: killed by a signal.
    if code == 0:
        return "survived"
    if code in (1, 2, 3) or code < 0:
        return "caught"
    return "error"


def _detail(verdict: str, code: int, tail: str) -> str:
    if verdict in ("error", "timeout"):
        lines = [line for line in tail.splitlines() if line.strip()]
        return f"exit {code}: " + " | ".join(lines[-3:])
    return ""


# --- reporting ------------------------------------------------------------------------------


def summarize(results: Sequence[Result], areas: Sequence[str]) -> tuple[str, int]:
    rows = ["area        mutants  caught  survived  timeouts  equivalent  errors  score"]
    live = 0
    for name in areas:
        mine = [r for r in results if r.mutant.area == name]
        equivalent = [r for r in mine if r.mutant.key in REVIEWED_EQUIVALENTS]
        counted = [r for r in mine if r.mutant.key not in REVIEWED_EQUIVALENTS]
        caught = sum(r.verdict in ("caught", "timeout") for r in counted)
        survived = sum(r.verdict == "survived" for r in counted)
        timeouts = sum(r.verdict == "timeout" for r in counted)
        errors = sum(r.verdict == "error" for r in counted)
        live += survived
        scored = caught + survived
        score = f"{100 * caught / scored:.1f}%" if scored else "-"
        rows.append(
            f"{name:<11} {len(mine):>7}  {caught:>6}  {survived:>8}  {timeouts:>8}  "
            f"{len(equivalent):>10}  {errors:>6}  {score:>5}"
        )
    counted_all = [r for r in results if r.mutant.key not in REVIEWED_EQUIVALENTS]
    caught_all = sum(r.verdict in ("caught", "timeout") for r in counted_all)
    scored_all = caught_all + sum(r.verdict == "survived" for r in counted_all)
    if scored_all:
        rows.append(
            f"{'all':<11} {len(results):>7}  {caught_all:>6}  {scored_all - caught_all:>8}"
            f"{'':>40}{100 * caught_all / scored_all:.1f}%"
        )
    rows.append("(score: caught, timeouts included, of the mutants not reviewed as equivalent)")
    return "\n".join(rows), live


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--area", action="append", choices=sorted(AREAS), help="default: all")
    parser.add_argument("--only", help="only mutants whose key contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--sample", type=int, help="run this many mutants per area, at random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="mutants at once (one copy each)")
    parser.add_argument("--isolation", choices=("fork", "subprocess"), default="fork")
    parser.add_argument("--timeout", type=float, default=10.0, help="per test, in seconds")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument(
        "--no-confirm",
        dest="confirm",
        action="store_false",
        help="count a mutant as surviving when the tests that run its lines miss it, without "
        "running all of the area's tests (faster; misses what one test leaves for another)",
    )
    parser.add_argument(
        "--survivors-of",
        type=Path,
        help="only the mutants that survived in this --json file of an earlier run",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 if any mutant survives")
    parser.add_argument("--keep", action="store_true", help="keep the copies (printed)")
    options = parser.parse_args(argv)
    # Killed (tox, CI, kill <pid>): still run the finally blocks that remove the copies.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    areas = options.area or list(AREAS)

    mutants = generate(areas)
    if options.only:
        mutants = [m for m in mutants if options.only in m.key]
    if options.survivors_of:
        earlier = json.loads(options.survivors_of.read_text())
        survived = {r["key"] for r in earlier if r["verdict"] == "survived"}
        mutants = [m for m in mutants if m.key in survived]
    if options.sample:
        rng = random.Random(options.seed)
        sampled: list[Mutant] = []
        for name in areas:
            mine = [m for m in mutants if m.area == name]
            sampled += sorted(rng.sample(mine, min(options.sample, len(mine))), key=mutants.index)
        mutants = sampled
        print(f"sampled {options.sample} mutants per area (seed {options.seed})")
    stale = set(REVIEWED_EQUIVALENTS) - {m.key for m in generate(list(AREAS))}
    for key in sorted(stale):
        print(f"note: reviewed equivalent no longer generated (remove it): {key}")
    if options.list:
        for mutant in mutants:
            mark = "  [equivalent]" if mutant.key in REVIEWED_EQUIVALENTS else ""
            print(f"{mutant.area:<10} {mutant.shown}{mark}")
        print(f"{len(mutants)} mutants")
        return 0
    to_run = [m for m in mutants if m.key not in REVIEWED_EQUIVALENTS]
    skipped = [m for m in mutants if m.key in REVIEWED_EQUIVALENTS]

    runner: Runner | None = None
    workdir = Path(tempfile.mkdtemp(prefix="cloudshards-mutation-"))
    trees = [workdir / f"tree{slot}" for slot in range(max(1, options.jobs))]
    try:
        for tree in trees:
            copy_tree(tree)
        test_map = TestMap()
        tests_of = {name: AREAS[name].tests for name in areas}
        longest = 0.0
        for name in areas:
            area = AREAS[name]
            missing = [t for t in area.tests if not (trees[0] / t).exists()]
            if missing:
                print(f"{name}: no {', '.join(missing)} here; running without")
                area = dataclasses.replace(
                    area, tests=tuple(t for t in area.tests if t not in missing)
                )
                tests_of[name] = area.tests
            elapsed = baseline(trees[0], name, area, options.timeout, test_map)
            longest = max(longest, elapsed)
            count = sum(m.area == name for m in to_run)
            print(f"{name}: tests pass unmutated ({elapsed:.0f} s with coverage); {count} mutants")
        if options.isolation == "fork":
            _preload()
        runner = Runner(
            trees,
            options.isolation,
            options.timeout,
            hard_limit_s=max(120.0, 3 * longest),
            confirm=options.confirm,
        )
        started = time.monotonic()

        def report(result: Result, done: int, total: int) -> None:
            if result.verdict != "caught":
                print(f"[{done}/{total}] {result.verdict:<8} {result.mutant.shown}", flush=True)
            elif done % 25 == 0:
                print(f"[{done}/{total}] {time.monotonic() - started:.0f} s", flush=True)

        results = runner.run(to_run, test_map, tests_of, report)
    finally:
        if runner is not None:
            runner.stop()
        if options.keep:
            print(f"copies kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results += [Result(m, "equivalent", 0.0, "-") for m in skipped]
    results.sort(key=lambda r: (areas.index(r.mutant.area), r.mutant.path, r.mutant.line))

    table, live = summarize(results, areas)
    print()
    print(table)
    for title, verdict in (
        ("Surviving", "survived"),
        ("Timed out (counted as caught)", "timeout"),
        ("Errors", "error"),
    ):
        chosen = [r for r in results if r.verdict == verdict]
        if chosen:
            print(f"\n{title}:")
            for r in chosen:
                print(f"  {r.mutant.shown}" + (f"\n      {r.detail}" if r.detail else ""))
                if verdict == "survived":
                    print(f"      key: {r.mutant.key}")
    print(f"\n{time.monotonic() - started:.0f} s for {len(to_run)} mutants")
    if options.json:
        options.json.write_text(
            json.dumps(
                [
                    {
                        "area": r.mutant.area,
                        "key": r.mutant.key,
                        "path": r.mutant.path,
                        "line": r.mutant.line,
                        "verdict": r.verdict,
                        "stage": r.stage,
                        "seconds": round(r.seconds, 2),
                    }
                    for r in results
                ],
                indent=1,
                ensure_ascii=False,
            )
        )
    return 1 if options.strict and live else 0


def _preload() -> None:
    """Import what every test run needs (not cloudshards) once, before the forks. Not pytest's
    plugins (pytest_timeout, hypothesis): pytest must import those itself, to rewrite them."""
    for module in ("pytest", "numpy", "torch", "fsspec", "PIL.Image"):
        with contextlib.suppress(ImportError):
            __import__(module)
    assert "cloudshards" not in sys.modules


if __name__ == "__main__":
    sys.exit(main())
