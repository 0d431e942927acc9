"""Launch a script under torchrun (one or several "nodes" on this machine) from a test.

Every launch has a timeout: a hang (the classic DDP hang at the last all-reduce) fails the test
instead of stalling CI, and kills every process the launch started: torchrun, its ranks (each
in a session of its own) and their DataLoader workers. A failed launch raises an
``AssertionError`` that shows each node's exit status and the end of its stdout and stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from servers import free_port

__all__ = [
    "NODE_RANK",
    "NodeResult",
    "RankSummary",
    "TorchrunError",
    "TorchrunResult",
    "descendants",
    "is_running",
    "torchrun",
]

DEFAULT_TIMEOUT_S = 180.0
#: After one node fails, how long the others get to notice before they are killed (a peer
#: that lost its partner waits in a collective until gloo's 30-minute timeout otherwise).
FAILURE_GRACE_S = 15.0
#: Variables of an enclosing torchrun/SLURM job or of cloudshards that would change the run.
_INHERITED_PREFIXES = ("CLOUDSHARDS_", "WDS_", "TORCHELASTIC_", "SLURM_")
_INHERITED_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORKER",
    "NUM_WORKERS",
)
_PORT_CLASH = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)
#: The one-line summary every example script prints per rank at the end. Not anchored at a
#: line start: ranks share torchrun's stdout, and print() writes the newline separately.
SUMMARY_LINE = re.compile(
    r"rank (?P<rank>\d+)/(?P<world>\d+): (?P<epochs>\d+) epochs, (?P<steps>\d+) steps, "
    r"(?P<samples>\d+) samples(?:, loss (?P<loss>nan|-?\d+\.\d+))?"
)
_TAIL_CHARS = 6000

#: Where the sitecustomize that dumps stacks on SIGUSR1 lives, and how long a dump may take.
_HANGDUMP = Path(__file__).with_name("hangdump")
_DUMP_S = 2.0


class TorchrunError(AssertionError):
    """A launch failed, timed out, or printed no summary; the message has the logs."""


@dataclass(frozen=True)
class RankSummary:
    """What a rank reported in its final line."""

    rank: int
    world_size: int
    epochs: int
    steps: int
    samples: int
    loss: str | None  # as printed: equal strings mean equal training (to 4 decimals)


@dataclass
class NodeResult:
    """One torchrun process (one "node")."""

    node_rank: int
    argv: list[str]
    returncode: int | None = None  # None: killed
    killed: str = ""  # why it was killed
    stdout: str = ""
    stderr: str = ""


@dataclass
class TorchrunResult:
    """The outcome of one launch: every node's output, and whether it ran out of time."""

    nodes: list[NodeResult]
    elapsed_s: float
    timeout_s: float
    timed_out: bool = False
    attempts: int = 1
    summaries: dict[int, RankSummary] = field(default_factory=dict)

    def __repr__(self) -> str:  # pytest prints it in tracebacks: keep it short
        statuses = [node.returncode for node in self.nodes]
        return (
            f"TorchrunResult(exit={statuses}, timed_out={self.timed_out}, "
            f"elapsed_s={self.elapsed_s:.1f})"
        )

    @property
    def ok(self) -> bool:
        """Every node exited with status 0 in time."""
        return not self.timed_out and all(node.returncode == 0 for node in self.nodes)

    @property
    def stdout(self) -> str:
        """All nodes' stdout, node 0 first."""
        return "".join(node.stdout for node in self.nodes)

    def describe(self) -> str:
        """Exit statuses and the end of every node's stdout and stderr."""
        head = (
            f"torchrun {'TIMED OUT after' if self.timed_out else 'finished in'} "
            f"{self.elapsed_s:.1f} s (limit {self.timeout_s:.0f} s, attempt {self.attempts})"
        )
        parts = [head]
        for node in self.nodes:
            status = f"killed ({node.killed})" if node.killed else f"exit {node.returncode}"
            parts.append(f"=== node {node.node_rank}: {status}: {' '.join(node.argv)}")
            parts.append(f"--- stdout (tail) ---\n{node.stdout[-_TAIL_CHARS:]}")
            parts.append(f"--- stderr (tail) ---\n{node.stderr[-_TAIL_CHARS:]}")
        return "\n".join(parts)

    def check(self, world_size: int) -> TorchrunResult:
        """Raise :class:`TorchrunError` unless every node succeeded and every rank of
        ``world_size`` printed its summary line exactly once."""
        if not self.ok:
            raise TorchrunError(self.describe())
        found = [_summary(m) for m in SUMMARY_LINE.finditer(self.stdout)]
        ranks = sorted(s.rank for s in found)
        if ranks != list(range(world_size)) or any(s.world_size != world_size for s in found):
            raise TorchrunError(
                f"expected one summary line from each of {world_size} ranks, got {found}\n"
                + self.describe()
            )
        self.summaries = {s.rank: s for s in found}
        return self


def _summary(match: re.Match[str]) -> RankSummary:
    return RankSummary(
        rank=int(match["rank"]),
        world_size=int(match["world"]),
        epochs=int(match["epochs"]),
        steps=int(match["steps"]),
        samples=int(match["samples"]),
        loss=match["loss"],
    )


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(_INHERITED_PREFIXES) and name not in _INHERITED_NAMES
    }
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the log as they happen (seen after a kill)
    env["OMP_NUM_THREADS"] = "1"  # 2 cores; also silences torchrun's warning about it
    env.update(extra or {})
    # Every process prints its threads' stacks on SIGUSR1 (hangdump/sitecustomize.py).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_HANGDUMP), env.get("PYTHONPATH")]))
    return env


def _node_argv(
    script: Path, args: Sequence[str], nproc_per_node: int, nnodes: int, node_rank: int, port: int
) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` console script
    if nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        # Static rendezvous: node_rank decides the ranks (c10d would go by arrival order).
        rendezvous = [
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            "--rdzv_backend=static",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
        ]
    return [
        *launcher,
        *rendezvous,
        f"--nproc_per_node={nproc_per_node}",
        "--max_restarts=0",
        str(script),
        *args,
    ]


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc; empty where there is none)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name (field 2) may hold spaces and parentheses: split after it.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _dump_stacks(process: subprocess.Popen[bytes]) -> None:
    """Have every Python process below ``process`` print its threads' stacks (see
    hangdump/sitecustomize.py), and give them a moment to."""
    for pid in descendants(process.pid):
        _signal(pid, signal.SIGUSR1)
    time.sleep(_DUMP_S)


def _kill(process: subprocess.Popen[bytes]) -> None:
    # torchrun runs each rank in a session of its own (so killing torchrun's group would leave
    # the ranks running): find every process below it, then kill them all, with their groups
    # (a rank's DataLoader workers are in the rank's group). The tree is frozen first
    # (SIGSTOP, listed again until no new process appears): on a loaded machine torchrun may
    # still be starting a rank when the timeout fires, and a rank started after the listing
    # would outlive the kill (orphaned, no longer below torchrun).
    frozen = [process.pid]
    _signal(process.pid, signal.SIGSTOP)
    while True:
        new = [pid for pid in descendants(process.pid) if pid not in frozen]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen.extend(new)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # pid leads its group (start_new_session)
        _signal(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def _launch_once(
    script: Path,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int,
    env: dict[str, str],
    timeout_s: float,
    cwd: Path | None,
) -> TorchrunResult:
    port = free_port()
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    nodes: list[NodeResult] = []
    running: list[tuple[NodeResult, subprocess.Popen[bytes], IO[bytes], IO[bytes]]] = []
    with contextlib.ExitStack() as stack:
        for node_rank in range(nnodes):
            argv = _node_argv(script, args, nproc_per_node, nnodes, node_rank, port)
            out = stack.enter_context(tempfile.TemporaryFile())
            err = stack.enter_context(tempfile.TemporaryFile())
            node_env = {k: v.replace(NODE_RANK, str(node_rank)) for k, v in env.items()}
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=node_env,
                cwd=cwd,
                start_new_session=True,
            )
            node = NodeResult(node_rank=node_rank, argv=argv)
            nodes.append(node)
            running.append((node, process, out, err))
        timed_out = False
        try:
            pending = list(running)
            failed_at: float | None = None
            while pending:
                now = time.monotonic()
                for item in list(pending):
                    code = item[1].poll()
                    if code is not None:
                        item[0].returncode = code
                        pending.remove(item)
                        if code != 0 and failed_at is None:
                            failed_at = now
                if not pending:
                    break
                if now > deadline:
                    timed_out = True
                    break
                if failed_at is not None and now > failed_at + FAILURE_GRACE_S:
                    break  # a peer failed; the rest would wait for it forever
                time.sleep(0.05)
        finally:
            for node, process, node_out, node_err in running:
                if process.poll() is None:
                    if timed_out:
                        _dump_stacks(process)
                    _kill(process)
                    node.returncode = None
                    node.killed = "timeout" if timed_out else "a peer failed"
                node.stdout, node.stderr = _read(node_out), _read(node_err)
    return TorchrunResult(
        nodes=nodes, elapsed_s=time.monotonic() - t0, timeout_s=timeout_s, timed_out=timed_out
    )


#: In a value of ``torchrun(env=...)``, replaced by each node's rank.
NODE_RANK = "{node_rank}"


def torchrun(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 2,
    nnodes: int = 1,
    env: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cwd: str | os.PathLike[str] | None = None,
    attempts: int = 3,
) -> TorchrunResult:
    """Run ``script args`` under torchrun and wait for it, at most ``timeout_s``.

    ``nnodes == 1`` is ``torchrun --standalone --nproc_per_node=N``; more nodes start one
    torchrun per node with ``--nnodes --node_rank --master_addr=127.0.0.1 --master_port=P``
    (static rendezvous on a free port), all on this machine. The environment is this process's
    minus any enclosing job's rank variables, plus ``env``, where :data:`NODE_RANK` in a value
    becomes the node's rank (a directory per node: what separate machines have). A launch that
    lost its port to
    another program (the port was free when chosen) is retried with a new one.

    Returns:
        The result; call :meth:`TorchrunResult.check` to fail on errors, timeouts and missing
        summary lines.
    """
    child_env = _child_env(env)
    result: TorchrunResult | None = None
    for attempt in range(1, attempts + 1):
        result = _launch_once(
            Path(script),
            args,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            env=child_env,
            timeout_s=timeout_s,
            cwd=Path(cwd) if cwd is not None else None,
        )
        result.attempts = attempt
        clash = any(_PORT_CLASH.search(node.stderr) for node in result.nodes)
        if result.ok or not clash:
            break
    assert result is not None
    return result
