"""URL expansion, protocol resolution, storage options and redaction."""

from __future__ import annotations

import socket
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import Shards
from fsspec.registry import _registry as fsspec_registry
from fsspec.utils import infer_storage_options

import cloudshards as wds
from cloudshards import urls
from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.process import PerProcess
from cloudshards.redact import caused_by, redact_text, redact_url
from cloudshards.urls import expand_urls, options_for, protocol_of, resolve


def test_brace_expansion_ranges_lists_and_nesting() -> None:
    assert expand_urls("s3://b/train-{000..002}.tar") == [
        "s3://b/train-000.tar",
        "s3://b/train-001.tar",
        "s3://b/train-002.tar",
    ]
    assert expand_urls("gs://b/{a,b}-{0..1}.tar") == [
        "gs://b/a-0.tar",
        "gs://b/a-1.tar",
        "gs://b/b-0.tar",
        "gs://b/b-1.tar",
    ]
    assert expand_urls("x-{a,b{1..2}}.tar") == ["x-a.tar", "x-b1.tar", "x-b2.tar"]


def test_double_colon_lists_and_explicit_lists() -> None:
    assert expand_urls("a.tar::b-{0..1}.tar") == ["a.tar", "b-0.tar", "b-1.tar"]
    assert expand_urls(["s3://b/x.tar", "s3://b/y-{0..1}.tar"]) == [
        "s3://b/x.tar",
        "s3://b/y-0.tar",
        "s3://b/y-1.tar",
    ]


def test_fsspec_chained_url_is_not_split() -> None:
    assert expand_urls("simplecache::s3://b/x.tar") == ["simplecache::s3://b/x.tar"]


def test_line_breaks_and_leading_blanks_are_dropped_as_webdataset_did() -> None:
    """A shard list read with ``readlines()`` ends each URL in a line break: webdataset opened
    them through Python's URL parser, which drops those (and leading blanks)."""
    assert expand_urls(["data/a.tar\n", " data/b.tar\r\n", "\tdata/c.tar", "s3://b/d.tar\n"]) == [
        "data/a.tar",
        "data/b.tar",
        "data/c.tar",
        "s3://b/d.tar",
    ]
    assert expand_urls("data/e-{0..1}.tar\n") == ["data/e-0.tar", "data/e-1.tar"]


def test_a_pipe_command_keeps_its_tabs_and_inner_line_breaks() -> None:
    """A ``pipe:`` spec is a shell command, run as written (webdataset never parsed it): a tab
    in ``cut -d'<TAB>'`` or a line break in a script is the command's, not a list's."""
    command = "pipe:cut -d'\t' -f1 list.tsv | xargs cat\necho done"
    assert expand_urls([f"  {command}\n"]) == [command]


def test_an_ipv6_host_is_not_a_list_separator() -> None:
    """``::`` inside ``[...]`` is an IPv6 address, not webdataset's list syntax."""
    assert expand_urls("http://[::1]:8000/a-{0..1}.tar") == [
        "http://[::1]:8000/a-0.tar",
        "http://[::1]:8000/a-1.tar",
    ]
    assert expand_urls("http://[::1]:8000/a.tar::http://[fe80::2]/b.tar") == [
        "http://[::1]:8000/a.tar",
        "http://[fe80::2]/b.tar",
    ]


def test_an_fsspec_chain_reads_its_target_never_a_local_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``simplecache::memory://b/a.tar`` reads the memory object, not ``./b/a.tar`` under the
    working directory; and the target's credentials rule holds inside a chain."""
    import cloudshards as wds

    def shard(text: bytes) -> bytes:
        import io
        import tarfile

        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            info = tarfile.TarInfo("k.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
        return out.getvalue()

    fs = fsspec.filesystem("memory")
    fs.pipe("/chainbucket/a.tar", shard(b"remote"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chainbucket").mkdir()
    (tmp_path / "chainbucket" / "a.tar").write_bytes(shard(b"local"))
    try:
        got = [s["txt"] for s in wds.WebDataset("simplecache::memory://chainbucket/a.tar")]
    finally:
        fs.rm("/chainbucket", recursive=True)
    assert got == [b"remote"]
    with pytest.raises(ConfigError, match="not credentials") as info:
        expand_urls("simplecache::s3://AKIAKEY:SECRET@bucket/a.tar")
    assert "SECRET" not in str(info.value)


def test_a_spec_expanding_past_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few bytes of braces can name billions of URLs: past CLOUDSHARDS_MAX_SHARDS (counted
    over the whole spec) the spec is refused before memory fills."""
    monkeypatch.setenv("CLOUDSHARDS_MAX_SHARDS", "1000")
    assert len(expand_urls("s3://b/{0..999}.tar")) == 1000
    with pytest.raises(ConfigError, match="over 1,000 URLs"):
        expand_urls("s3://b/{0..1000}.tar")
    with pytest.raises(ConfigError, match="CLOUDSHARDS_MAX_SHARDS"):
        expand_urls("s3://b/{0..600}.tar::s3://c/{0..600}.tar")


def test_env_substitution_uses_wds_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDS_BUCKET", "my-bucket")
    assert expand_urls("s3://${BUCKET}/a.tar") == ["s3://my-bucket/a.tar"]
    with pytest.raises(ConfigError, match="WDS_MISSING"):
        expand_urls("s3://${MISSING}/a.tar")


def test_empty_expansion_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no URLs"):
        expand_urls([])


def test_glob_on_local_and_memory_filesystems(tmp_path: Path) -> None:
    for name in ("train-0.tar", "train-1.tar", "val-0.tar"):
        (tmp_path / name).write_bytes(b"x")
    assert expand_urls(f"{tmp_path}/train-*.tar") == [
        f"{tmp_path}/train-0.tar",
        f"{tmp_path}/train-1.tar",
    ]
    mem = fsspec.filesystem("memory")
    mem.pipe({"/globtest/a-1.tar": b"1", "/globtest/a-2.tar": b"2", "/globtest/b.tar": b"3"})
    try:
        assert expand_urls("memory://globtest/a-?.tar") == [
            "memory:///globtest/a-1.tar",
            "memory:///globtest/a-2.tar",
        ]
    finally:
        mem.rm("/globtest", recursive=True)


def test_a_shard_named_like_a_glob_is_read_as_named(tmp_path: Path) -> None:
    # webdataset opens "data[1].tar" as named; as a glob it would be data1.tar.
    for name in ("data[1].tar", "data1.tar"):
        (tmp_path / name).write_bytes(b"x")
    assert expand_urls(f"{tmp_path}/data[1].tar") == [f"{tmp_path}/data[1].tar"]
    assert expand_urls([f"{tmp_path}/data[1].tar"]) == [f"{tmp_path}/data[1].tar"]
    assert expand_urls(f"{tmp_path}/data[0-9].tar") == [f"{tmp_path}/data1.tar"]  # no such file
    mem = fsspec.filesystem("memory")
    mem.pipe({"/globname/a[1].tar": b"1", "/globname/a1.tar": b"2"})
    try:
        assert expand_urls("memory://globname/a[1].tar") == ["memory://globname/a[1].tar"]
    finally:
        mem.rm("/globname", recursive=True)


def test_glob_without_match_names_the_pattern(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"matched no shards"):
        expand_urls(f"{tmp_path}/nothing-*.tar")


def test_http_query_question_mark_is_not_a_glob() -> None:
    url = "https://host/a.tar?X-Amz-Signature=abc"
    assert expand_urls(url) == [url]


def test_protocol_of() -> None:
    assert protocol_of("/data/a.tar") == "file"
    assert protocol_of("relative/a.tar") == "file"
    assert protocol_of("file:///data/a.tar") == "file"
    assert protocol_of("S3://b/k") == "s3"
    assert protocol_of("pipe:cat a.tar") == "pipe"
    # An fsspec chain is named by its outermost protocol: never a path in the working directory.
    assert protocol_of("simplecache::s3://b/k") == "simplecache"
    assert protocol_of("simplecache::file:///data/a.tar") == "simplecache"


def test_options_per_protocol_with_aliases() -> None:
    opts = {"s3": {"anon": True}, "gs": {"token": "anon"}, "http": {"client_kwargs": {}}}
    assert options_for("s3", opts) == {"anon": True}
    assert options_for("s3a", opts) == {"anon": True}
    assert options_for("gcs", opts) == {"token": "anon"}
    assert options_for("https", opts) == {"client_kwargs": {}}
    assert options_for("memory", opts) == {}
    assert options_for("s3", None) == {}


def test_flat_options_apply_to_every_protocol() -> None:
    assert options_for("s3", {"anon": True}) == {"anon": True}


def test_non_mapping_protocol_options_are_rejected() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        options_for("s3", {"s3": "anon"})


def test_resolve_local_memory_and_caching(tmp_path: Path) -> None:
    fs, path = resolve(str(tmp_path / "a.tar"))
    assert "file" in fs.protocol
    assert path.endswith("a.tar")
    fs2, _ = resolve(f"file://{tmp_path}/b.tar")
    assert fs2 is fs
    _, mpath = resolve("memory://bucket/key.tar")
    assert mpath == "/bucket/key.tar"


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown protocol 'nosuchproto'"):
        resolve("nosuchproto://x/y.tar")


def test_missing_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hide s3fs as if it were not installed: the error must name cloudshards[s3].
    monkeypatch.setitem(sys.modules, "s3fs", None)
    from cloudshards import urls

    monkeypatch.setattr(urls, "_fs_cache", PerProcess(dict))
    with pytest.raises(ConfigError, match=r'pip install "cloudshards\[s3\]"'):
        resolve("s3://bucket/a.tar", {"s3": {"anon": True, "skip_instance_cache": True}})


def test_pipe_urls_are_not_resolved_as_filesystems() -> None:
    with pytest.raises(ConfigError, match="pipe"):
        resolve("pipe:cat a.tar")


def test_redaction_of_credentials_and_queries() -> None:
    assert (
        redact_url("s3://AKIAXX:secret@bucket/k.tar?X-Amz-Signature=abc")
        == "s3://<redacted>@bucket/k.tar?<redacted>"
    )
    assert redact_url("https://h/a.tar#frag") == "https://h/a.tar"
    assert redact_url("/local/path.tar") == "/local/path.tar"
    assert "sig" not in redact_url("pipe:curl https://h/a.tar?sig=zz")
    assert redact_text("GET https://u:p@h/x?token=zz failed") == (
        "GET https://<redacted>@h/x?<redacted> failed"
    )


def test_errors_never_show_secrets() -> None:
    from cloudshards.errors import ShardFormatError, ShardOpenError

    url = "https://user:hunter2@host/a.tar?X-Goog-Signature=SECRET"
    for error in (
        ShardOpenError("object not found", url=url, offset=7),
        ShardFormatError("bad header", url=url, member="k.jpg", offset=512),
    ):
        text = str(error)
        assert "hunter2" not in text
        assert "SECRET" not in text
        assert "https://<redacted>@host/a.tar?<redacted>" in text
        assert error.url == "https://<redacted>@host/a.tar?<redacted>"


# ------------------------------------------------------------------ building a filesystem


@pytest.fixture
def fresh_filesystems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(urls, "_fs_cache", PerProcess(dict))


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A local port that refuses connections: bound, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def everything_said(error: BaseException) -> str:
    """The error's text, traceback, and every exception reachable from it (causes, contexts)."""
    said = ["".join(traceback.format_exception(error))]
    stack: list[BaseException | None] = [error]
    seen: set[int] = set()
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        said += [str(exc), repr(exc), repr(exc.args), repr(vars(exc))]
        stack += [exc.__cause__, exc.__context__]
    return "\n".join(said)


@pytest.mark.usefixtures("fresh_filesystems")
def test_a_backend_that_cannot_start_is_a_shard_open_error_naming_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zip:// opens its archive when built (without one, the working directory): the OSError
    is a ShardOpenError naming the URL and what the URL lacks, for a chain built by fsspec
    too."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardOpenError, match="cannot set up the zip:// filesystem") as info:
        resolve("zip://a.tar")
    assert isinstance(info.value, OSError)
    assert info.value.url == "zip://a.tar"
    assert "IsADirectoryError" in str(info.value)
    assert "(shard zip://a.tar)" in str(info.value)
    assert "give the archive as storage_options={'zip': {'fo': URL}}" in str(info.value)
    assert caused_by(info.value, IsADirectoryError)
    assert info.value.__context__ is None
    chain = f"zip::file://{tmp_path}/missing.zip"
    with pytest.raises(ShardOpenError, match="FileNotFoundError") as info:
        resolve(chain)
    assert info.value.url == chain
    assert caused_by(info.value, FileNotFoundError)


@pytest.mark.usefixtures("fresh_filesystems")
def test_an_ftp_url_gives_its_host_to_the_filesystem_and_its_password_to_no_message(
    refused_port: int,
) -> None:
    """fsspec's FTP filesystem takes the server from the URL (url_to_fs passes it) and
    connects when built: a refused connection is a ShardOpenError, and the password in the
    URL is in neither the message nor anything chained to it."""
    url = f"ftp://alice:hunter2@127.0.0.1:{refused_port}/x.tar"
    with pytest.raises(ShardOpenError, match="ConnectionRefusedError") as info:
        resolve(url)
    assert info.value.url == f"ftp://<redacted>@127.0.0.1:{refused_port}/x.tar"
    assert caused_by(info.value, ConnectionRefusedError)
    assert "hunter2" not in everything_said(info.value)


def test_an_ftp_url_without_a_host_says_so() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^ftp:///x\.tar: the ftp:// filesystem needs an argument the URL does not give "
        r"\(missing a required argument: 'host'\)",
    ):
        resolve("ftp:///x.tar")


class HostFileSystem(fsspec.AbstractFileSystem):  # type: ignore[misc]
    """``hosttest://HOST:PORT/path``: a filesystem per server, as fsspec's FTP and SFTP ones."""

    protocol = "hosttest"
    cachable = False

    def __init__(self, host: str, port: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host, self.port = host, port

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        found = infer_storage_options(path)
        return {key: found[key] for key in ("host", "port") if key in found}


@pytest.mark.usefixtures("fresh_filesystems")
def test_a_filesystem_per_server_named_in_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fsspec_registry, "hosttest", HostFileSystem)
    one, _ = resolve("hosttest://one:21/a.tar")
    again, _ = resolve("hosttest://one:21/b.tar")
    two, _ = resolve("hosttest://two/a.tar")
    assert again is one
    assert two is not one
    assert (one.host, one.port, two.host, two.port) == ("one", 21, "two", 1)
    chosen, _ = resolve("hosttest://one:21/a.tar", {"port": 2121})
    assert (chosen.host, chosen.port) == ("one", 2121)  # storage_options win, as in fsspec


@pytest.mark.usefixtures("fresh_filesystems")
def test_the_handler_skips_a_shard_whose_backend_cannot_start(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_port: int
) -> None:
    shards: Shards = make_shards([2])
    monkeypatch.chdir(tmp_path)
    ftp = f"ftp://127.0.0.1:{refused_port}/x.tar"
    shard_urls = ["zip://a.tar", ftp, str(shards.paths[0])]
    with pytest.raises(ShardOpenError, match=r"\(shard zip://a\.tar\)"):
        list(wds.WebDataset(shard_urls, shardshuffle=False))
    skipping = wds.WebDataset(shard_urls, shardshuffle=False, handler=wds.warn_and_continue)
    with pytest.warns(UserWarning, match="cannot set up the") as warned:
        got = [sample["__key__"] for sample in skipping]
    assert got == shards.keys
    said = [str(warning.message) for warning in warned]
    assert any("(shard zip://a.tar)" in text for text in said)
    assert any(f"(shard {ftp})" in text for text in said)
