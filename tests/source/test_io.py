"""Opening shards: local and memory filesystems, error mapping, the pipe: opt-in."""

from __future__ import annotations

import contextlib
import errno
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakes
import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import cloudshards as wds
from cloudshards.errors import ConfigError, ShardFormatError, ShardNotFoundError, ShardOpenError
from cloudshards.source import OpenOptions, open_shard


@pytest.fixture
def memory_dir() -> Any:
    fs = fsspec.filesystem("memory")
    fs.mkdir("/iotest")
    yield fs
    fs.rm("/iotest", recursive=True)


def test_open_local_reads_everything(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(b"abc" * 1000)
    with open_shard(str(path)) as stream:
        assert stream.read(10) == b"abcabcabca"
        buffer = bytearray(100)
        assert stream.readinto(buffer) == 100
        rest = stream.read()
    assert len(rest) == 3000 - 110
    assert stream.offset == 3000


def test_open_file_url_and_memory(tmp_path: Path, memory_dir: MemoryFileSystem) -> None:
    (tmp_path / "b.tar").write_bytes(b"xyz")
    with open_shard(f"file://{tmp_path}/b.tar") as stream:
        assert stream.read() == b"xyz"
    memory_dir.pipe("/iotest/c.tar", b"hello")
    with open_shard("memory://iotest/c.tar") as stream:
        assert stream.read() == b"hello"


def test_missing_object_names_the_url(tmp_path: Path, memory_dir: MemoryFileSystem) -> None:
    for url in (str(tmp_path / "missing.tar"), "memory://iotest/missing.tar"):
        with pytest.raises(ShardOpenError, match="object not found") as info:
            open_shard(url, shard_index=3)
        assert "missing.tar" in str(info.value)
        assert info.value.shard_index == 3
        # webdataset lets open() or fsspec raise FileNotFoundError: code that catches it still does.
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, ShardNotFoundError)
        copy = pickle.loads(pickle.dumps(info.value))  # from a DataLoader worker
        assert isinstance(copy, ShardNotFoundError)
        assert str(copy) == str(info.value)
        for error in (info.value, copy):  # code that checks errno, as open() sets it
            assert (error.errno, error.filename) == (errno.ENOENT, url)
            assert error.strerror == "object not found"


def test_directory_is_not_a_shard(tmp_path: Path) -> None:
    with pytest.raises(ShardOpenError):
        open_shard(str(tmp_path))


class _FailingFile:
    def __init__(self) -> None:
        self.reads = 0

    def read(self, size: int = -1) -> bytes:
        self.reads += 1
        if self.reads > 1:
            raise ConnectionResetError("connection reset by peer")
        return b"x" * 10

    def close(self) -> None:
        pass


def test_read_errors_become_shard_open_errors_with_offset() -> None:
    from cloudshards.source import ShardStream

    stream = ShardStream(_FailingFile(), "s3://bucket/a.tar?X-Amz-Signature=SECRET")  # type: ignore[arg-type]
    assert stream.read(10) == b"x" * 10
    with pytest.raises(ShardOpenError) as info:
        stream.read(10)
    message = str(info.value)
    assert "connection reset" in message
    assert "byte offset 10" in message
    assert "SECRET" not in message
    assert info.value.offset == 10


def test_pipe_urls_need_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.tar"
    path.write_bytes(b"piped")
    url = f"pipe:cat {path}"
    with pytest.raises(ConfigError, match="allow_pipe=True"):
        open_shard(url)
    with open_shard(url, OpenOptions(allow_pipe=True)) as stream:
        assert stream.read() == b"piped"
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PIPE", "1")
    with open_shard(url) as stream:
        assert stream.read() == b"piped"


def test_failing_pipe_command_is_an_open_error(tmp_path: Path) -> None:
    with (
        pytest.raises(ShardOpenError, match="status"),
        open_shard("pipe:exit 3", OpenOptions(allow_pipe=True)) as stream,
    ):
        stream.read()


def test_a_failing_pipe_command_is_named_by_its_program_only() -> None:
    with (
        pytest.raises(ShardOpenError, match="'sh' exited with status 3") as info,
        open_shard("pipe:sh -c 'exit 3' -- TOKEN=SECRET", OpenOptions(allow_pipe=True)) as stream,
    ):
        stream.read()
    assert "SECRET" not in str(info.value)


def test_closing_a_pipe_early_stops_what_its_shell_started(tmp_path: Path) -> None:
    """A reader that stops early (a ``slice``, a crash) leaves no command running behind it."""
    path, pid_file = tmp_path / "p.tar", tmp_path / "pid"
    path.write_bytes(b"x" * 100)
    command = f"pipe:sleep 60 & echo $! > {pid_file}; cat {path}; wait"
    with open_shard(command, OpenOptions(allow_pipe=True)) as stream:
        assert stream.read(10) == b"x" * 10
    assert fakes.ends_soon(int(pid_file.read_text()))


def test_pipe_is_refused_by_webdataset_pipeline(make_shards: Any) -> None:
    shards = make_shards([2])
    ds = wds.WebDataset(f"pipe:cat {shards.paths[0]}", shardshuffle=False)
    with pytest.raises(ConfigError, match="pipe"):
        list(ds)
    allowed = wds.WebDataset(f"pipe:cat {shards.paths[0]}", shardshuffle=False, allow_pipe=True)
    assert [s["__key__"] for s in allowed] == shards.keys


def test_errors_pickle_with_their_fields() -> None:
    error = ShardFormatError("truncated", url="s3://b/a.tar?sig=1", offset=1024, member="k.jpg")
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is ShardFormatError
    assert str(clone) == str(error)
    assert (clone.url, clone.offset, clone.member) == (error.url, 1024, "k.jpg")


def test_errors_from_dataloader_workers_keep_their_fields(make_shards: Any, tmp_path: Path) -> None:
    """torch re-raises a worker's error as ``type(its traceback's text)``: the URL, member and
    offset the message names are its fields again (they were None)."""
    import torch.utils.data

    shard = make_shards([3]).paths[0]
    cut = tmp_path / "cut.tar"
    cut.write_bytes(shard.read_bytes()[:1800])  # inside the second member's data
    errors = []
    for workers in (0, 1):
        ds = wds.WebDataset(str(cut), shardshuffle=False)
        with pytest.raises(ShardFormatError) as info:
            list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))
        errors.append(info.value)
    here, there = errors
    assert "DataLoader worker" in str(there)
    assert (there.url, there.member, there.offset) == (here.url, here.member, here.offset)
    assert there.url == str(cut)
    assert there.member is not None
    assert there.offset is not None
    assert str(there).endswith(str(here).rpartition(" (")[2])


@pytest.mark.parametrize(
    ("status", "missing"), [(None, True), (404, True), (401, False), (403, False)]
)
def test_a_refusal_under_fsspecs_not_found_is_access_denied(
    status: int | None, missing: bool
) -> None:
    """fsspec's HTTP info() raises FileNotFoundError for any failure, its cause the answer: a
    401 or 403 is a credentials problem, reported as one, not a missing object."""
    from cloudshards.source import map_backend_error

    class Answer(Exception):
        def __init__(self, status: int | None) -> None:
            super().__init__(f"{status}, message='Unauthorized'")
            self.status = status

    try:
        try:
            raise Answer(status)
        except Answer as answer:
            raise FileNotFoundError("https://h/x.tar") from answer
    except FileNotFoundError as exc:
        error = map_backend_error(exc, "https://h/x.tar")
    assert isinstance(error, ShardNotFoundError) is missing
    assert isinstance(error, ShardOpenError)
    if not missing:
        assert "access denied" in str(error)


@pytest.mark.parametrize(
    ("message", "denied"),
    [
        ("500, message='Internal Server Error', url='https://h/train-000403.tar'", False),
        (
            "500, message='Internal Server Error', url='https://h/x.tar?X-Amz-Date=20240101T0'",
            False,
        ),
        ("Server error '500' for url (https://h/shard-401.tar)", False),
        ("403, message='Forbidden', url='https://h/x.tar'", True),
        ("HTTP status client error (401 Unauthorized) for url (https://h/x.tar)", True),
        ("Server returned status 403.", True),
        ("[Errno 5] Input/output error: '/data/403/x.tar'", False),
        ("read failed: bucket/2024/401/train-0.tar", False),
    ],
)
def test_a_status_in_the_url_is_no_access_denied(message: str, denied: bool) -> None:
    """A 500 on ``train-000403.tar`` (or a signed URL dated 2024-01-01) was reported as
    "access denied (check credentials ...)": 401 and 403 were looked for anywhere in the
    text, the URLs it quotes included."""
    from cloudshards.source import map_backend_error

    class ClientResponseError(Exception):
        pass

    error = map_backend_error(ClientResponseError(message), "https://h/x.tar")
    assert ("access denied" in str(error)) is denied


class _Answer(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"{status}, message='Service Unavailable'")
        self.status = status


class ClientConnectorError(OSError):
    """Named as aiohttp's: a refused connection."""


@pytest.mark.parametrize(
    ("cause", "missing"),
    [
        (_Answer(404), True),
        (_Answer(410), True),
        (_Answer(500), False),
        (_Answer(503), False),
        (_Answer(429), False),
        (_Answer(408), False),
        (ConnectionRefusedError(111, "Connection refused"), False),
        (ClientConnectorError(111, "Cannot connect to host"), False),
        (TimeoutError(), False),
    ],
    ids=lambda v: getattr(v, "status", None) or type(v).__name__,
)
def test_a_server_error_under_fsspecs_not_found_is_retried_not_missing(
    cause: Exception, missing: bool
) -> None:
    """fsspec's HTTP info() turns a 503 or a refused connection into FileNotFoundError too:
    reported as missing, a skipping handler would drop a shard that comes back on retry."""
    from cloudshards.source import is_retryable, map_backend_error

    try:
        try:
            raise cause
        except Exception as answer:
            raise FileNotFoundError("https://h/x.tar") from answer
    except FileNotFoundError as exc:
        error = map_backend_error(exc, "https://h/x.tar")
        retryable = is_retryable(exc)
    assert retryable is not missing
    assert isinstance(error, ShardNotFoundError) is missing
    assert isinstance(error, ShardOpenError)
    if not missing:
        assert type(cause).__name__ in str(error)


@contextlib.contextmanager
def holding_server(answer: bytes | None = None) -> Iterator[int]:
    """A server on 127.0.0.1 that accepts every connection and holds it open, saying nothing
    or, given ``answer``, reading the request and sending ``answer`` and nothing more. Yields
    its port."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    done = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            with contextlib.suppress(OSError):
                connection = server.accept()[0]
                held.append(connection)
                if answer is not None:
                    connection.recv(65536)
                    connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_server_that_never_answers_fails_within_the_stall_timeout() -> None:
    """fsspec's HTTP info() waits up to aiohttp's 300 s for an answer, and tries HEAD, then
    GET: a server that accepts and says nothing once held a reader for ten minutes."""
    with holding_server() as port:
        url = f"http://127.0.0.1:{port}/a.tar"
        with pytest.raises(ShardOpenError, match=r"stalled|Timeout"):
            list(wds.WebDataset(url, stall_timeout_s=2, retries=1, shardshuffle=False))


@pytest.mark.parametrize(
    "message",
    [
        "The provided token is malformed or otherwise invalid.",  # S3's InvalidToken
        "The provided token has expired.",  # S3's ExpiredToken
    ],
)
def test_s3_token_errors_as_s3fs_raises_them_fail_at_once(message: str) -> None:
    """s3fs turns S3's InvalidToken and ExpiredToken into OSError(EINVAL) with only the
    message: a credential problem, not a transient failure to retry six times."""
    import errno

    from cloudshards.source import is_retryable, map_backend_error

    exc = OSError(errno.EINVAL, message)
    assert not is_retryable(exc)
    assert "access denied" in str(map_backend_error(exc, "s3://b/k.tar"))


@pytest.mark.parametrize("bug", [NameError("name 'x' is not defined"), NotImplementedError()])
def test_a_bug_is_raised_at_once_not_retried_as_transient(
    bug: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """A NameError from a backend or a hook is not the store's: retrying it six times, logged
    as transient and backed off, only delays the traceback the user needs."""
    from cloudshards.source import FetchOptions
    from cloudshards.source.retries import IOStats, retry

    calls: list[int] = []

    def call() -> bytes:
        calls.append(1)
        raise bug

    stats = IOStats()
    with pytest.raises(ShardOpenError, match=type(bug).__name__) as raised:
        retry(call, url="s3://b/k.tar", offset=0, options=FetchOptions(retries=5), stats=stats)
    assert calls == [1]
    assert raised.value.__cause__ is not None
    assert (stats.retries, stats.failures) == (0, 1)
    assert "retry" not in caplog.text


@pytest.mark.timeout(60)
def test_an_s3_answer_that_stalls_mid_body_is_reported_as_stalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through obstore, a GET whose body stops coming failed with "request or response body
    error": its read timeout (stall_timeout_s) shows only in the debug text. The error says
    the answer stalled, as for every other protocol, and names the shard."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\nContent-Type: application/x-tar\r\n"
        b'ETag: "0123456789abcdef0123456789abcdef"\r\n'
        b"Last-Modified: Sun, 29 Nov 2026 06:00:00 GMT\r\n\r\n"
    )
    with holding_server(head + bytes(1000)) as port:  # then nothing more
        options = {
            "s3": {
                "endpoint_url": f"http://127.0.0.1:{port}",
                "key": "k",
                "secret": "s",
                "client_kwargs": {"region_name": "us-east-1"},
            }
        }
        with pytest.raises(ShardOpenError, match="stalled") as info:
            list(
                wds.WebDataset(
                    "s3://bucket/a.tar",
                    storage_options=options,
                    stall_timeout_s=1,
                    retries=0,
                    shardshuffle=False,
                )
            )
        assert info.value.url == "s3://bucket/a.tar"
