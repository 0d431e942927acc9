"""cloudshards.finalize: closing what an abandoned reader holds, also at interpreter exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import fakes

_ABANDONED_AT_EXIT = """
import sys
import cloudshards as wds

dataset = wds.WebDataset(sys.argv[1], shardshuffle=False)
it = iter(dataset)
next(it)  # a reader left half-read...
cycle = [it]
cycle.append(cycle)  # ...in a reference cycle (a caught exception's frames hold one so)
del it, cycle
print("exiting", flush=True)
"""


def test_a_reader_abandoned_in_a_cycle_lets_the_interpreter_exit(
    make_shards: Any, tmp_path: Path
) -> None:
    """The interpreter's last garbage collections finalize the reader; its close once started
    a thread there, which never ran, and the process waited for it forever (a DDP job that
    broke out of its epoch and exited hung in 2 of 3 runs)."""
    spec = make_shards([50, 50]).spec()
    script = tmp_path / "abandoned.py"
    script.write_text(_ABANDONED_AT_EXIT)
    result = subprocess.run(
        [sys.executable, str(script), spec],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exiting" in result.stdout


_CACHED_READER_LEFT_OPEN = """
import sys
import fsspec
import cloudshards as wds

memory = fsspec.filesystem("memory")
for i, path in enumerate(sys.argv[2:]):
    memory.pipe(f"/bucket/shard-{i}.tar", open(path, "rb").read())
url = "memory://bucket/shard-{0..1}.tar"
dataset = wds.WebDataset(url, shardshuffle=False, cache_dir=sys.argv[1])
it = iter(dataset)  # a global: torn down with the modules
next(it)
print("exiting", flush=True)
"""


def test_a_cached_reader_left_open_at_exit_prints_nothing(make_shards: Any, tmp_path: Path) -> None:
    """A script that stops reading and exits (``next(iter(loader))``) closed the reader while
    the modules were torn down; its cache's close then failed importing ("Exception ignored
    in: <generator ...> ... ModuleNotFoundError: import of io halted")."""
    shards = make_shards([50, 50])
    script = tmp_path / "left_open.py"
    script.write_text(_CACHED_READER_LEFT_OPEN)
    argv = [sys.executable, str(script), str(tmp_path / "cache"), *map(str, shards.paths)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "exiting\n"
    assert result.stderr == ""


_PIPE_LEFT_OPEN = """
import sys
import cloudshards as wds

shard, pid_file = sys.argv[1], sys.argv[2]
command = f"pipe:sleep 60 & echo $! > {pid_file}; cat {shard}; wait"
it = iter(wds.WebDataset(command, shardshuffle=False, allow_pipe=True))
next(it)  # left open in a global when the script ends
print("exiting", flush=True)
"""


def test_a_pipe_command_left_open_at_exit_is_stopped(make_shards: Any, tmp_path: Path) -> None:
    """A reader left open at exit is not closed while the modules are torn down, and its
    command runs in a session of its own (no Ctrl-C reaches it): it was left running."""
    shards = make_shards([5])
    script, pid_file = tmp_path / "pipe_left_open.py", tmp_path / "pid"
    script.write_text(_PIPE_LEFT_OPEN)
    argv = [sys.executable, str(script), str(shards.paths[0]), str(pid_file)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert fakes.ends_soon(int(pid_file.read_text()))
