"""Secrets in a shard URL never reach what a user or a log collector prints.

A URL with a password (``http://alice:PASSWORD@host/...``) and a signed query string
(``?X-Amz-Signature=...``) is read through real servers: nginx, and the cloud simulator in front
of it answering 403. Whatever happens, the secrets appear nowhere: not in the error's text, its
repr, its traceback, any exception of its cause/context chain (walked by hand, suppressed or
not), the error re-raised from a DataLoader worker, or any record that fsspec, aiohttp or
cloudshards log at DEBUG, tracebacks included.
"""

from __future__ import annotations

import io
import logging
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch.utils.data
from cloudsim import CloudSim
from cloudsim_fixtures import cloudsim_factory  # noqa: F401

import cloudshards as wds
from cloudshards.errors import ShardOpenError
from cloudshards.redact import install_log_redaction
from cloudshards.source import OpenOptions
from cloudshards.source.transport import object_size

if TYPE_CHECKING:
    from conftest import RemoteDataset

PASSWORD = "hunter2-PASSWORD"
SIGNATURE = "f00dSIGNATUREcafe"
SECRETS = (PASSWORD, SIGNATURE)


def secret_url(base_url: str, name: str) -> str:
    """``base_url/name`` with a password in the user info and a signed query string."""
    scheme, rest = base_url.split("://", 1)
    return f"{scheme}://alice:{PASSWORD}@{rest}/{name}?X-Amz-Signature={SIGNATURE}&x=1"


def chain(error: BaseException) -> Iterator[BaseException]:
    """Every exception reachable from ``error`` through __cause__ and __context__."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        exc = todo.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]


def assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked in:\n{text}"


def assert_error_clean(error: BaseException) -> None:
    assert_clean(str(error))
    assert_clean(repr(error))
    assert_clean("".join(traceback.format_exception(error)))
    for exc in chain(error):
        assert_clean(str(exc))
        assert_clean(repr(exc))
        assert_clean(repr(vars(exc)))
        assert_clean(repr(exc.args))


@pytest.fixture
def forbidding(cloudsim: Callable[..., CloudSim], http_dataset: RemoteDataset) -> str:
    """The first shard's secret URL through a simulator that answers every request with 403."""
    sim = cloudsim(
        http_dataset.server.base_url,
        fail_every_n=1,
        fail_status=403,
        fail_methods=("GET", "HEAD"),
    )
    base = http_dataset.base_url.replace(http_dataset.server.base_url, sim.url, 1)
    return secret_url(base, http_dataset.local.shards[0])


@pytest.fixture
def debug_log() -> Iterator[io.StringIO]:
    """Everything logged anywhere at DEBUG, formatted with tracebacks as a log collector would."""
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield text
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def test_denied_read_error_carries_no_secret(forbidding: str) -> None:
    with pytest.raises(ShardOpenError) as info:
        list(wds.WebDataset(forbidding, shardshuffle=False))
    error = info.value
    assert "access denied" in str(error)
    assert "<redacted>@127.0.0.1" in str(error)
    # The backend's error is still there to debug with, redacted: type, status and frames.
    causes = [exc for exc in chain(error) if exc is not error]
    assert causes, "the backend's error should stay in the chain, redacted"
    assert any("403" in str(exc) for exc in causes)
    assert any(exc.__traceback__ is not None for exc in causes)
    assert_error_clean(error)


def test_worker_reraise_carries_no_secret(forbidding: str) -> None:
    dataset = wds.WebDataset(forbidding, shardshuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    with pytest.raises(ShardOpenError) as info:
        list(loader)
    # The worker's traceback text is part of the re-raised error's message.
    assert "Traceback" in str(info.value)
    assert "403" in str(info.value)
    assert_error_clean(info.value)


def test_debug_logs_of_backends_carry_no_secret(
    forbidding: str, http_dataset: RemoteDataset, debug_log: io.StringIO
) -> None:
    good = secret_url(http_dataset.base_url, http_dataset.local.shards[1])
    samples = list(wds.WebDataset(good, shardshuffle=False))
    assert len(samples) == len(http_dataset.local.shard_keys[1])
    with pytest.raises(ShardOpenError):
        list(wds.WebDataset(forbidding, shardshuffle=False))
    # Shard reads go through requests of cloudshards' own; metadata (a size, an index) goes
    # through fsspec's, which logs each URL.
    assert (
        object_size(good, OpenOptions())
        == (http_dataset.local.root / http_dataset.local.shards[1]).stat().st_size
    )
    logged = debug_log.getvalue()
    # The backends did log the URLs (so this checks something), with the secrets masked.
    assert "fsspec" in logged
    assert "<redacted>@127.0.0.1" in logged
    assert_clean(logged)


def test_other_log_records_are_untouched(debug_log: io.StringIO) -> None:
    """The filter on the backends' loggers hides secrets and nothing else."""
    install_log_redaction()
    message: Any = "plain %s with http://127.0.0.1/x.tar and key=value"
    logging.getLogger("fsspec.http").debug(message, "text")
    assert "plain text with http://127.0.0.1/x.tar and key=value" in debug_log.getvalue()
