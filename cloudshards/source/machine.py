"""What the node offers, read from the kernel: the memory this process's container may use and
the speed of the network interfaces. The node budget (:mod:`cloudshards.source.budget`) sizes
its defaults from them instead of fixed numbers: the bytes buffered ahead are a share of the
memory (a 16 GiB container does not get the 4 GiB a training host has to spare), and the
requests in flight are what it takes to fill the node's network links at the throughput one
connection was measured to carry.

Read by hand from ``/proc`` and ``/sys``: psutil knows the machine's memory but not a
container's (cgroup) limit, and no library reports link speeds.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["link_bytes_per_s", "memory_bytes"]

#: cgroup v1 writes a page-rounded 2**63 for "no limit"; anything this large is none.
_UNLIMITED = 1 << 60


def memory_bytes(root: str = "/") -> int | None:
    """The memory this process may use: the machine's (``MemTotal``), or its cgroup's limit
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) where lower; None if neither is
    readable. ``root`` is where ``/proc`` and ``/sys`` are found (tests give another)."""
    base = Path(root)
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (base / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                found.append(int(line.split()[1]) * 1024)
                break
    for path in _cgroup_limit_files(base):
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip()
            if text != "max" and 0 < int(text) < _UNLIMITED:
                found.append(int(text))
    return min(found) if found else None


def _cgroup_limit_files(base: Path) -> list[Path]:
    """The files that may hold this process's memory limit: its own cgroup's (the path
    ``/proc/self/cgroup`` names) and the mount's root (a container's own namespace)."""
    cgroups = base / "sys/fs/cgroup"
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in (base / "proc/self/cgroup").read_text().splitlines():
            fields = line.split(":", 2)
            if len(fields) != 3:
                continue
            _, controllers, path = fields
            if controllers == "":
                own["v2"] = path
            elif "memory" in controllers.split(","):
                own["v1"] = path
    files = []
    if "v2" in own:
        files.append(cgroups / own["v2"].lstrip("/") / "memory.max")
    files.append(cgroups / "memory.max")
    if "v1" in own:
        files.append(cgroups / "memory" / own["v1"].lstrip("/") / "memory.limit_in_bytes")
    files.append(cgroups / "memory/memory.limit_in_bytes")
    return files


def link_bytes_per_s(root: str = "/") -> int | None:
    """The bytes per second of the node's fastest network device that is up (its speed as the
    driver reports it, in ``/sys/class/net/*/speed``), or None when none reports one (many
    virtual NICs do not). Only interfaces backed by a device count: loopback, bridges and the
    veth pair of a container (whose fixed 10 Gbit/s says nothing of the host's NIC) have
    none, so a container on its own network sees no speed."""
    best = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(Path(root) / "sys/class/net"):
            directory = Path(entry.path)
            if not (directory / "device").exists():
                continue
            with contextlib.suppress(OSError, ValueError):
                if (directory / "operstate").read_text().strip() not in ("up", "unknown"):
                    continue
                megabits = int((directory / "speed").read_text().strip())
                best = max(best, megabits * 125_000)  # Mbit/s -> bytes/s
    return best or None
