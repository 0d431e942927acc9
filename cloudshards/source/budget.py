"""Requests in flight and throttling backoff shared by every process on a node.

Each DataLoader worker keeps its own shards' ranged GETs in flight (``concurrency`` per shard,
``prefetch`` shards ahead): 8 ranks x 8 workers would hold thousands of connections, far past
what a NIC needs and enough to trip a store's request-rate limits, and each worker would back
off from a 503 SlowDown on its own while the others kept hammering. Here:

- **Slots.** A request holds one of ``CLOUDSHARDS_NODE_REQUESTS`` slots (default 128) while it
  is in flight, shared by every process of the user on the machine. A slot is an advisory
  lock (``flock``) on a small file in a node-local directory, so a process that dies frees
  its slots with it. Written by hand: no library offers a semaphore that independent
  processes (torchrun's ranks, their forked workers) can share without a common parent.
- **Shared backoff.** A throttling answer (503 SlowDown, 429) makes the whole node wait: its
  delay is written to a file there, and every request first waits until that time. It also
  halves the slots the node's requests may use; each round of successful requests gives one
  back (additive increase, multiplicative decrease, as TCP does), so the node settles near
  what the store accepts.

- **Buffers.** The shards a process keeps in flight ahead of the one it reads hold up to
  ``concurrency x part_bytes`` each. ``CLOUDSHARDS_NODE_BUFFER_BYTES`` (default 4 GiB) is
  divided among the node's processes reading remote shards (each holds a lock on a member
  file while it lives, so the count follows them), and each keeps only as many shards ahead
  as its share holds, down to none: the shard being read always proceeds, so no process
  waits on another's buffers. 64 processes of the default settings would hold 6 GiB; under
  the budget they keep one shard ahead each, 4 GiB. One process alone keeps them all.

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
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cloudshards import config
from cloudshards.process import PerProcess

__all__ = ["NodeBudget", "forget", "node_budget"]

logger = logging.getLogger("cloudshards.fetch")

#: Default requests in flight per node: a 100 Gbit/s NIC at ~100 MB/s per connection.
DEFAULT_NODE_REQUESTS = 128

#: Default bytes the node's processes may hold in shards fetched ahead, all together.
DEFAULT_NODE_BUFFER_BYTES = 4 << 30

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

    def __init__(self, directory: Path, slots: int, buffer_bytes: int = 0) -> None:
        self.directory = directory
        self.slots = slots
        self.buffer_bytes = buffer_bytes
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

    def limit(self) -> int:
        """The slots requests may use now: all of them, or fewer after the store throttled
        (halved at each throttling, one more back after each round of successes; the cut
        lapses after ``_STALE_S`` without news, so a new job starts at full speed)."""
        shared = self._shared()
        if time.time() - shared["changed"] > _STALE_S:
            return self.slots
        return max(1, min(self.slots, int(shared["limit"])))

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
        limit = self.limit()
        if limit >= self.slots or self._successes < max(_ROUND, limit):
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


def _make() -> NodeBudget:
    slots = config.env_int("NODE_REQUESTS", DEFAULT_NODE_REQUESTS)
    buffer_bytes = config.env_int("NODE_BUFFER_BYTES", DEFAULT_NODE_BUFFER_BYTES)
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
    return NodeBudget(directory, slots, buffer_bytes)


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
