"""Requests in flight and throttling backoff shared by every process on a node.

Each DataLoader worker keeps its own shards' ranged GETs in flight (``concurrency`` per shard,
``prefetch`` shards ahead): 8 ranks x 8 workers would hold thousands of connections, far past
what a NIC needs and enough to trip a store's request-rate limits, and each worker would back
off from a 503 SlowDown on its own while the others kept hammering. Here:

- **Slots.** A request holds one of the node's slots while it is in flight, shared by every
  process of the user on the machine. How many: ``CLOUDSHARDS_NODE_REQUESTS``, else what fills
  the node's link (the speed its NIC reports) at the throughput this process measured one
  request to carry, a quarter over (a 100 Gbit/s NIC at 72 MB/s a request: 218; between 32
  and 1024), else 128 where the NIC reports no speed (many virtual ones). A slot is an advisory
  lock (``flock``) on a small file in a node-local directory, so a process that dies frees
  its slots with it. Written by hand: no library offers a semaphore that independent
  processes (torchrun's ranks, their forked workers) can share without a common parent.
- **Shared backoff.** A throttling answer (503 SlowDown, 429) makes the whole node wait: its
  delay is written to a file there, and every request first waits until that time. It also
  halves the slots the node's requests may use; each round of successful requests gives one
  back (additive increase, multiplicative decrease, as TCP does), so the node settles near
  what the store accepts.

- **Buffers.** The shards a process keeps in flight ahead of the one it reads hold up to
  ``concurrency x part_bytes`` each. ``CLOUDSHARDS_NODE_BUFFER_BYTES`` (by default a sixteenth
  of the memory the process may use, its container's limit where lower, between 256 MiB and
  4 GiB: :mod:`cloudshards.source.machine`) is divided among the node's processes reading
  remote shards (each holds a lock on a member file while it lives, so the count follows
  them), and each keeps only as many shards ahead as its share holds, down to none: the
  shard being read always proceeds, so no process waits on another's buffers. 64 processes
  of the fixed settings would hold 6 GiB; under a 4 GiB budget they keep one shard ahead
  each. One process alone keeps them all.

The directory is ``CLOUDSHARDS_NODE_DIR``, else ``/dev/shm/cloudshards-<uid>`` (memory, local
to the node; a home directory can be a network file system shared by nodes), else the
temporary directory. ``CLOUDSHARDS_NODE_REQUESTS=0`` turns the slots and the backoff off,
``CLOUDSHARDS_NODE_BUFFER_BYTES=0`` the buffer budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cloudshards import config
from cloudshards.process import PerProcess
from cloudshards.source import adapt, machine

__all__ = ["NodeBudget", "forget", "node_budget"]

logger = logging.getLogger("cloudshards.fetch")

#: Requests in flight per node where its link speed is unknown: a 100 Gbit/s NIC at ~100 MB/s
#: per connection.
DEFAULT_NODE_REQUESTS = 128

#: Bounds of the requests in flight sized from the node's link speed.
MIN_NODE_REQUESTS, MAX_NODE_REQUESTS = 32, 1024

#: What one request is taken to carry until one was measured: an S3 connection's ~100 MB/s,
#: for parts of 80 ms after a first byte in 30 ms.
NOMINAL_CONNECTION_BYTES_PER_S = 72e6

#: Requests in flight per those a link needs at the measured rate (for the ones that start late
#: or wait on a slow server).
_LINK_MARGIN = 1.25

#: Most bytes the node's processes may hold in shards fetched ahead, all together (by default
#: a sixteenth of the memory, between these bounds).
DEFAULT_NODE_BUFFER_BYTES = 4 << 30
MIN_NODE_BUFFER_BYTES = 256 << 20
_MEMORY_SHARE = 16

#: How long a count of the node's member processes is reused.
_MEMBERS_TTL_S = 2.0

#: First and longest pause between tries for a free slot.
_POLL_S, _MAX_POLL_S = 0.001, 0.05

#: Successful requests (at least) per slot given back after a throttling cut.
_ROUND = 8

#: Seconds without a throttling or a recovery after which a cut lapses.
_STALE_S = 60.0

_STATE_KEYS = ("until", "limit", "cut", "changed")


class NodeBudget:
    """This process's handle on the node's request slots and shared backoff."""

    def __init__(
        self,
        directory: Path,
        slots: int,
        buffer_bytes: int = 0,
        link_bytes_per_s: int | None = None,
    ) -> None:
        self.directory = directory
        self.slots = slots
        self.buffer_bytes = buffer_bytes
        #: The node's link speed: with it, the slots in use follow the measured connections.
        self.link_bytes_per_s = link_bytes_per_s
        self._member: int | None = None  # descriptor of this process's member file, locked
        self._member_name = ""
        self._members = (-_MEMBERS_TTL_S, 1)  # (when counted, processes counted)
        self._lock = threading.Lock()
        self._held: set[int] = set()  # slots this process's threads hold now
        self._files: dict[int, int] = {}  # slot -> this process's descriptor for it
        self._state_path = directory / "state"  # the shared backoff and limit, as JSON
        self._seen: tuple[int, dict[str, float]] = (-1, self._start())
        self._successes = 0
        self._rng = random.Random()
        self.waited_s = 0.0  # time spent waiting for slots or the backoff

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the node's slots (waiting for one, and for the node's backoff)."""
        if self.slots <= 0:
            yield
            return
        self.wait_backoff()
        number = self._acquire()
        try:
            yield
        finally:
            with self._lock:
                with contextlib.suppress(OSError):
                    fcntl.flock(self._files[number], fcntl.LOCK_UN)
                self._held.discard(number)
        self._succeeded()  # (not reached when the request raised)

    def _acquire(self) -> int:
        began = time.monotonic()
        pause = _POLL_S
        while True:
            limit = self.limit()
            with self._lock:
                start = self._rng.randrange(limit)
                for step in range(limit):
                    number = (start + step) % limit
                    if number in self._held:
                        continue
                    if self._try(number):
                        self._held.add(number)
                        if pause > _POLL_S:
                            self.waited_s += time.monotonic() - began
                        return number
            time.sleep(pause)
            pause = min(_MAX_POLL_S, pause * 2)

    def _try(self, number: int) -> bool:
        fd = self._files.get(number)
        if fd is None:
            path = self.directory / f"slot-{number}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._files[number] = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def shards_ahead(self, wanted: int, shard_bytes: int) -> int:
        """How many shards this process may keep in flight ahead of the one it reads:
        ``wanted``, or fewer when its share of the node's buffer budget holds fewer shards of
        ``shard_bytes`` (the one being read counts too)."""
        if self.buffer_bytes <= 0 or wanted <= 0 or shard_bytes <= 0:
            return wanted
        try:
            share = self.buffer_bytes // self.members()
        except OSError as exc:  # the node directory went away: keep the settings
            logger.debug("no buffer budget: %s", exc)
            return wanted
        return max(0, min(wanted, share // shard_bytes - 1))

    def members(self) -> int:
        """Processes of the node reading remote shards, this one included (counted by the
        locks on their member files; recounted every ``_MEMBERS_TTL_S``)."""
        now = time.monotonic()
        with self._lock:
            if self._member is None:
                self._member, self._member_name = _register(self.directory)
            if now - self._members[0] < _MEMBERS_TTL_S:
                return self._members[1]
        count = 1 + _live_members(self.directory, own=self._member_name)
        self._members = (now, count)
        return count

    def wait_backoff(self) -> None:
        """Sleep until the node's shared backoff (if any) has passed."""
        if self.slots <= 0:
            return
        delay = self._shared()["until"] - time.time()
        if delay > 0:
            self.waited_s += delay
            time.sleep(delay)

    def ceiling(self) -> int:
        """The slots requests may use while the store does not throttle: all of them, or,
        where the node's link speed is known, what fills it at the throughput this process
        measured one connection to carry (see :func:`requests_for_link`)."""
        if self.link_bytes_per_s is None:
            return self.slots
        rate = adapt.connection_rate()
        return min(self.slots, requests_for_link(self.link_bytes_per_s, rate))

    def limit(self) -> int:
        """The slots requests may use now: the :meth:`ceiling`, or fewer after the store
        throttled (halved at each throttling, one more back after each round of successes;
        the cut lapses after ``_STALE_S`` without news, so a new job starts at full speed)."""
        return self._cut(self.ceiling())

    def _cut(self, ceiling: int) -> int:
        """:meth:`limit` for a ``ceiling`` already known."""
        shared = self._shared()
        if time.time() - shared["changed"] > _STALE_S:
            return ceiling
        return max(1, min(ceiling, int(shared["limit"])))

    def _shared(self) -> dict[str, float]:
        """The node's shared state (re-read when its file changed)."""
        try:
            mtime = os.stat(self._state_path).st_mtime_ns
        except OSError:
            return self._start()
        if mtime != self._seen[0]:
            with contextlib.suppress(OSError, ValueError, TypeError):
                data = json.loads(self._state_path.read_text())
                self._seen = (mtime, {key: float(data[key]) for key in _STATE_KEYS})
        return self._seen[1]

    def _start(self) -> dict[str, float]:
        return {"until": 0.0, "limit": float(self.slots), "cut": 0.0, "changed": 0.0}

    def _update(self, change: Callable[[dict[str, float]], bool]) -> None:
        """Change the node's shared state under its lock (``change`` says if it did)."""
        with contextlib.suppress(OSError), open(self.directory / "state.lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            state = dict(self._shared())
            if not change(state):
                return
            state["changed"] = time.time()
            temp = self.directory / f".state-{os.getpid()}-{threading.get_ident()}"
            temp.write_text(json.dumps(state))
            os.replace(temp, self._state_path)

    def _succeeded(self) -> None:
        self._successes += 1
        ceiling = self.ceiling()
        limit = self._cut(ceiling)
        if limit >= ceiling or self._successes < max(_ROUND, limit):
            return
        self._successes = 0

        def grow(state: dict[str, float]) -> bool:
            state["limit"] = min(float(self.slots), max(1.0, state["limit"]) + 1)
            return True

        self._update(grow)

    def back_off(self, delay: float) -> None:
        """The store throttled us: make the whole node wait ``delay`` seconds from now, and
        halve the slots it may use (once per ``delay``: a burst of 503s halves it once)."""
        if self.slots <= 0:
            return
        now = time.time()

        def throttle(state: dict[str, float]) -> bool:
            state["until"] = max(state["until"], now + delay)
            if now - state["cut"] > delay:
                state["limit"] = max(1.0, float(self.limit() // 2))
                state["cut"] = now
            return True

        self._update(throttle)
        logger.warning(
            "the store throttles requests: this node waits %.2fs and keeps %d requests in flight",
            delay,
            self.limit(),
        )


def _register(directory: Path) -> tuple[int, str]:
    """A member file for this process, locked before it gets its ``member-`` name (so no
    scan ever finds it unlocked and takes it for a dead process's); the name is unique even
    across PID namespaces that share the directory."""
    name = f"member-{os.getpid()}-{os.urandom(4).hex()}"
    temporary = directory / f".{name}"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temporary, directory / name)
    except OSError:
        os.close(fd)
        raise
    return fd, name


def _live_members(directory: Path, own: str) -> int:
    """Member files of other live processes (locked); stale ones are removed."""
    live = 0
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith("member-") or entry.name == own:
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live += 1  # its process holds it
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # its process is gone
            finally:
                os.close(fd)
    return live


def _directory() -> Path:
    configured = config.env_str("NODE_DIR")
    if configured:
        return Path(configured)
    # A shared directory: _make checks that the one found is ours alone before using it.
    shm = Path("/dev/shm")  # noqa: S108
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"cloudshards-{os.getuid()}"


def requests_for_link(link_bytes_per_s: int, connection_bytes_per_s: float | None) -> int:
    """Requests in flight that fill a node's link: its speed over what one request carries
    (measured, first byte included; else :data:`NOMINAL_CONNECTION_BYTES_PER_S`), with a
    quarter more for those that start late, within :data:`MIN_NODE_REQUESTS` and
    :data:`MAX_NODE_REQUESTS`. A 100 Gbit/s NIC at the nominal rate: 218; 25 Gbit/s: 55;
    behind connections a quarter as fast, 4 times as many."""
    rate = connection_bytes_per_s or NOMINAL_CONNECTION_BYTES_PER_S
    wanted = math.ceil(_LINK_MARGIN * link_bytes_per_s / rate)
    return max(MIN_NODE_REQUESTS, min(MAX_NODE_REQUESTS, wanted))


def default_buffer_bytes(memory_bytes: int | None) -> int:
    """The node's buffer budget by default: a sixteenth of the memory the process may use
    (its container's limit where there is one), between :data:`MIN_NODE_BUFFER_BYTES` and
    :data:`DEFAULT_NODE_BUFFER_BYTES`; the latter when the memory is unknown."""
    if memory_bytes is None:
        return DEFAULT_NODE_BUFFER_BYTES
    share = memory_bytes // _MEMORY_SHARE
    return max(MIN_NODE_BUFFER_BYTES, min(DEFAULT_NODE_BUFFER_BYTES, share))


def _make() -> NodeBudget:
    # Unless configured, the requests follow the node's link (where it reports its speed)
    # and the buffers its memory.
    link = None if config.env_str("NODE_REQUESTS") else machine.link_bytes_per_s()
    slots = config.env_int(
        "NODE_REQUESTS", DEFAULT_NODE_REQUESTS if link is None else MAX_NODE_REQUESTS
    )
    buffer_bytes = config.env_int("NODE_BUFFER_BYTES", default_buffer_bytes(machine.memory_bytes()))
    directory = _directory()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        found = os.lstat(directory)
        if not os.path.isdir(directory) or os.path.islink(directory):
            raise OSError("not a directory")
        if found.st_uid != os.getuid() or found.st_mode & 0o022:
            # Someone else's (or writable by others): their files could jam our requests.
            raise OSError("owned by another user or writable by others")
    except OSError as exc:
        logger.warning("no node request budget (cannot use %s: %s)", directory, exc)
        slots = buffer_bytes = 0
    return NodeBudget(directory, slots, buffer_bytes, link)


_budget: PerProcess[NodeBudget] = PerProcess(_make)


def node_budget() -> NodeBudget:
    """This process's handle on its node's budget (a forked child makes its own)."""
    return _budget.get()


def forget() -> None:
    """Drop this process's handle (the next request reads the settings again)."""
    budget = _budget.pop()
    if budget is not None:
        member = [] if budget._member is None else [budget._member]
        for fd in [*budget._files.values(), *member]:
            with contextlib.suppress(OSError):
                os.close(fd)
