"""Secrets never printed: URL redaction, exception chains, backend log records, the retry
warning, the ``pipe:`` refusal, option reprs, and member names shown by the CLI."""

from __future__ import annotations

import io
import logging
import pickle
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloudshards.cli import main
from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.redact import (
    RedactedError,
    install_log_redaction,
    raise_redacted,
    redact_text,
    redact_url,
    scrubbed,
)
from cloudshards.source import FetchOptions, OpenOptions, map_backend_error, open_shard
from cloudshards.source import retries as fetch

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # A password with an unencoded "/", "#", "?" or "@" (not a valid URL, but typed by users).
        ("http://alice:hun/ter2@host/x.tar", "http://<redacted>@host/x.tar"),
        ("http://alice:hun#ter2@host/x.tar", "http://<redacted>@host/x.tar"),
        ("http://alice:hun?ter2@host/x.tar", "http://<redacted>@host/x.tar"),
        ("http://alice:hu@n/ter2@host/x.tar?sig=1", "http://<redacted>@host/x.tar?<redacted>"),
        ("https://alice:hunter2@host/a.tar", "https://<redacted>@host/a.tar"),
        ("https://hunter2@host/a.tar", "https://<redacted>@host/a.tar"),
        # Nothing secret: left alone, "@" in a path and host:port included.
        ("http://host:8080/a@2x.tar", "http://host:8080/a@2x.tar"),
        ("s3://bucket/user@example.com/a.tar", "s3://bucket/user@example.com/a.tar"),
        ("/data/a:b@c.tar", "/data/a:b@c.tar"),
        ("memory:///bucket/x.tar", "memory:///bucket/x.tar"),
        ("file:///data/x.tar", "file:///data/x.tar"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_redact_text_masks_secret_headers_and_nothing_else() -> None:
    logged = (
        "Sending http request: <AWSPreparedRequest headers={'Authorization': "
        "b'AWS4-HMAC-SHA256 Credential=AKIAEXAMPLE/20261124/us-east-1/s3/aws4_request, "
        f"Signature={SECRET}', 'X-Amz-Security-Token': b'{SECRET}', 'Range': 'bytes=0-9'}}>"
    )
    clean = redact_text(logged)
    assert SECRET not in clean
    assert "AKIAEXAMPLE" not in clean
    assert "'Range': 'bytes=0-9'" in clean
    canonical = f"GET\n/b/k.tar\n\nhost:127.0.0.1\nx-amz-security-token:{SECRET}\n"
    assert redact_text(canonical) == (
        "GET\n/b/k.tar\n\nhost:127.0.0.1\nx-amz-security-token:<redacted>\n"
    )
    assert redact_text("Authorization: Bearer abc.def") == "Authorization: <redacted>"
    plain = "member 'a.jpg' at offset 512: key=value (bucket b)"
    assert redact_text(plain) == plain


@pytest.mark.parametrize(
    "text",
    [
        # A quote is legal unencoded in a password and a query string (RFC 3986).
        f"FileNotFoundError: http://alice:hun'{SECRET}@h:1/missing.tar?X-Amz-Signature=s&t=1",
        f"GET http://h/x.tar?filename='a.tar'&Signature={SECRET}&Key-Pair-Id=KP1 failed",
        f"https://h/x?response-content-disposition=attachment;filename='a'&token={SECRET}",
        f'url="http://alice:it\'s{SECRET}@host/x.tar"',
        f"('gs://b/k.tar?X-Goog-Signature={SECRET}', 3)",
        # CloudFront and token query fields outside a URL, as a backend may print them.
        f"token={SECRET}",
        f"Signature: {SECRET}",
        f"Key-Pair-Id={SECRET}&Policy={SECRET}",
    ],
)
def test_redact_text_masks_urls_with_quotes_in_them(text: str) -> None:
    assert SECRET not in redact_text(text)


def test_quoted_urls_end_at_their_closing_quote() -> None:
    text = "opening 's3://bucket/train-000.tar' failed (shard 3), see 'https://h/doc'"
    assert redact_text(text) == text


def backend_failure() -> OSError:
    """A backend error chained the way aiohttp's are, its URL holding a password."""
    try:
        try:
            raise ConnectionResetError(f"reset by http://alice:{SECRET}@host/x.tar?sig=s")
        except ConnectionResetError as inner:
            raise OSError(f"403 for url http://alice:{SECRET}@host/x.tar") from inner
    except OSError as exc:
        return exc


def test_scrubbed_copies_the_whole_chain_without_secrets() -> None:
    original = backend_failure()
    copy = scrubbed(original)
    assert isinstance(copy, RedactedError)
    assert copy.type_name == "OSError"
    assert "403 for url http://<redacted>@host/x.tar" in str(copy)
    assert copy.__traceback__ is original.__traceback__
    assert isinstance(copy.__cause__, RedactedError)
    assert copy.__cause__.type_name == "ConnectionResetError"
    assert SECRET not in "".join(traceback.format_exception(copy))
    clone = pickle.loads(pickle.dumps(copy))
    assert (str(clone), clone.type_name) == (str(copy), copy.type_name)


def test_raised_error_leaves_no_raw_exception_reachable() -> None:
    url = f"http://alice:{SECRET}@host/x.tar?X-Amz-Signature={SECRET}"

    def fail() -> None:
        try:
            raise backend_failure()
        except OSError as exc:
            raise_redacted(map_backend_error(exc, url), exc)

    with pytest.raises(ShardOpenError) as info:
        fail()
    error = info.value
    assert error.__context__ is None
    assert error.__suppress_context__
    text = "".join(traceback.format_exception(error))
    assert "403 for url http://<redacted>@host/x.tar" in text  # the cause is still shown
    seen, todo = [], [error]
    while todo:
        exc = todo.pop()
        seen.append(exc)
        assert SECRET not in f"{exc} {exc!r} {vars(exc)}"
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    assert len(seen) == 3  # ours, the OSError's copy, the reset's copy
    assert SECRET not in text


@pytest.fixture
def backend_log() -> Iterator[io.StringIO]:
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.DEBUG)
    install_log_redaction()
    try:
        yield text
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


@pytest.mark.parametrize("name", ["fsspec.http", "s3fs", "gcsfs", "aiohttp.client", "botocore"])
def test_backend_loggers_are_redacted(backend_log: io.StringIO, name: str) -> None:
    url = f"https://alice:{SECRET}@host/x.tar?X-Goog-Signature={SECRET}"
    log = logging.getLogger(name)
    log.debug(url)
    log.debug("GET %s", url)
    try:
        raise backend_failure()
    except OSError:
        log.debug("", exc_info=True)
    text = backend_log.getvalue()
    assert SECRET not in text
    assert text.count("https://<redacted>@host/x.tar?<redacted>") == 2
    assert "403 for url http://<redacted>@host/x.tar" in text  # the traceback is still logged


def test_credentials_in_sts_and_imds_answers_are_masked(backend_log: io.StringIO) -> None:
    """botocore logs response bodies at DEBUG: STS's XML, the instance metadata's JSON, and
    credential dicts name their secrets in CamelCase or with suffixes."""
    sts = (
        b"<Credentials><AccessKeyId>ASIAEXAMPLE</AccessKeyId><SecretAccessKey>STSSECRET1"
        b"</SecretAccessKey><SessionToken>STSSESSION2</SessionToken></Credentials>"
    )
    imds = '{\n  "AccessKeyId" : "ASIAEX",\n  "SecretAccessKey" : "IMDSSECRET3",\n'
    imds += '  "Token" : "T4"\n}'
    logging.getLogger("botocore.parsers").debug("Response body:\n%r", sts)
    logging.getLogger("botocore.utils").debug("Response: %s", imds)
    creds = {"access_key": "ASIA", "secret_key": "DICTSECRET5", "token": "DICTTOKEN6"}
    logging.getLogger("aiobotocore.credentials").debug("creds %r", creds)
    logged = backend_log.getvalue()
    for secret in ("STSSECRET1", "STSSESSION2", "IMDSSECRET3", '"T4"', "DICTSECRET5", "DICTTOKEN6"):
        assert secret not in logged
    assert "ASIAEXAMPLE" in logged  # the key's id is not a secret, and helps debugging


@pytest.mark.parametrize(
    "text",
    [
        "tokenizer=bert-base-uncased, max_length=128",
        "max_tokens: 512 exceeds the limit",
        "ExpiredToken: The provided token has expired.",
        "SignatureDoesNotMatch: The request signature we calculated does not match",
        "decoding field txt of sample tokens_000123: bad utf-8",
        "/data/tokenizer=llama3/shard-000.tar",
    ],
)
def test_words_that_only_contain_a_secrets_name_are_left_alone(text: str) -> None:
    """Error messages keep what explains them: a tokenizer, a sample key, a Hive-style
    path, a store's error code and its message."""
    assert redact_text(text) == text


def test_new_backend_child_loggers_are_covered(backend_log: io.StringIO) -> None:
    log = logging.getLogger("s3fs.cloudshards_test_child")  # created after the first install
    install_log_redaction()
    log.debug("https://alice:%s@host/x.tar", SECRET)
    assert SECRET not in backend_log.getvalue()
    assert "https://<redacted>@host/x.tar" in backend_log.getvalue()


def test_user_loggers_are_not_touched(backend_log: io.StringIO) -> None:
    logging.getLogger("my_training").debug("https://alice:%s@host/x.tar", SECRET)
    assert f"https://alice:{SECRET}@host/x.tar" in backend_log.getvalue()


def test_retry_warning_logs_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    url = f"https://alice:{SECRET}@host/x.tar?X-Amz-Signature={SECRET}"
    calls = []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError(f"connection reset reading {url}")
        return b"ok"

    options = FetchOptions(retries=2, backoff_s=0.0, max_backoff_s=0.0)
    with caplog.at_level(logging.WARNING, logger="cloudshards.fetch"):
        assert fetch.retry(flaky, url=url, offset=0, options=options) == b"ok"
    warnings = [r.getMessage() for r in caplog.records if r.name == "cloudshards.fetch"]
    assert len(warnings) == 1
    assert "retry 1/2" in warnings[0]
    assert "https://<redacted>@host/x.tar?<redacted>" in warnings[0]
    assert SECRET not in warnings[0]


def test_pipe_refusal_does_not_echo_the_command() -> None:
    with pytest.raises(ConfigError) as info:
        open_shard(f"pipe:curl -s -H 'Authorization: Bearer {SECRET}' https://host/x.tar")
    assert SECRET not in str(info.value)
    assert "pipe:curl" in str(info.value)
    assert "allow_pipe=True" in str(info.value)
    with pytest.raises(ConfigError) as info:  # a variable set before the program
        open_shard(f"pipe:HF_TOKEN={SECRET} curl -s https://host/x.tar")
    assert SECRET not in str(info.value)
    assert "pipe:curl" in str(info.value)


def test_options_repr_hides_storage_options() -> None:
    options = OpenOptions(storage_options={"s3": {"key": "AKIAEXAMPLE", "secret": SECRET}})
    assert SECRET not in repr(options)
    assert "AKIAEXAMPLE" not in repr(options)


def test_cli_escapes_control_characters_in_member_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tarfile

    shard = tmp_path / "evil.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("a\x1b]0;pwned\x07\x1b[2J.txt", "b\u202egpj.exe.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    assert main(["cat", str(shard)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "\x07" not in out
    assert "\u202e" not in out
    assert "a\\x1b]0;pwned\\x07\\x1b[2J" in out
    assert "b\\u202egpj" in out


def test_open_failure_chain_is_clean_end_to_end(tmp_path: Path) -> None:
    """A real backend failure (memory:// object missing) keeps a redacted, debuggable cause."""
    url = f"memory://bucket/missing-{tmp_path.name}.tar"
    with pytest.raises(ShardOpenError) as info:
        open_shard(url)
    cause: Any = info.value.__cause__
    assert isinstance(cause, RedactedError)
    assert cause.type_name == "FileNotFoundError"
    assert info.value.__context__ is None


def test_redacted_causes_keep_their_kind_for_retry_decisions() -> None:
    """Permanent failures stay permanent although the cause is now a redacted copy: a missing
    object is asked for once, not retried; a reset is retried."""
    from cloudshards.redact import caused_by
    from cloudshards.source import is_retryable

    missing = map_backend_error(FileNotFoundError("gone"), "s3://b/k.tar")
    missing.__cause__ = scrubbed(FileNotFoundError("gone"))
    assert caused_by(missing, FileNotFoundError)
    assert not caused_by(missing, PermissionError)
    assert not is_retryable(missing)
    reset = map_backend_error(ConnectionResetError("reset"), "s3://b/k.tar")
    reset.__cause__ = scrubbed(ConnectionResetError("reset"))
    assert is_retryable(reset)
    clone = pickle.loads(pickle.dumps(missing.__cause__))
    assert clone.original_type is None  # what remains: type name, text, errno and status
    assert clone.type_name == "FileNotFoundError"

    calls = []

    def get() -> bytes:
        calls.append(1)
        try:
            raise FileNotFoundError("no such key")
        except FileNotFoundError as exc:
            raise_redacted(map_backend_error(exc, "s3://b/k.tar"), exc)

    with pytest.raises(ShardOpenError, match="object not found"):
        fetch.retry(get, url="s3://b/k.tar", offset=0, options=FetchOptions(retries=3))
    assert len(calls) == 1


# --- gaps found by the mutation check (integration/mutation.py) ------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # "://" again in the query (a redirect target): only the first one ends the scheme.
        ("https://host/go?to=https://other/x", "https://host/go?<redacted>"),
        # A password ending in "/": the user info still ends at the last "@".
        ("http://alice:hunter2/@host/x.tar", "http://<redacted>@host/x.tar"),
        # Two "@" without a "user:" prefix: the host is what follows the last one.
        ("https://tok@en@host/a.tar", "https://<redacted>@host/a.tar"),
    ],
)
def test_redact_url_edge_cases(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_redacted_error_text_and_numbers() -> None:
    assert str(RedactedError("ValueError", "bad")) == "ValueError: bad"
    assert str(RedactedError("ValueError", "")) == "ValueError"
    copy = scrubbed(FileNotFoundError(2, "No such file", f"http://alice:{SECRET}@host/x"))
    assert copy is not None
    assert (copy.errno, copy.status) == (2, None)
    assert SECRET not in str(copy)

    class StatusError(Exception):
        status = 503

    class CodeError(Exception):
        code = 404  # urllib's HTTPError names it "code"

    class OddError(Exception):
        errno = "ENOENT"  # not a number: not kept
        status = "busy"

    assert getattr(scrubbed(StatusError("x")), "status", None) == 503
    assert getattr(scrubbed(CodeError("x")), "status", None) == 404
    odd = scrubbed(OddError("x"))
    assert odd is not None
    assert (odd.errno, odd.status) == (None, None)


def chain(length: int) -> BaseException:
    """An exception with ``length - 1`` causes behind it."""
    error: BaseException = ValueError("0")
    for depth in range(1, length):
        newer = ValueError(str(depth))
        newer.__cause__ = error
        error = newer
    return error


def copied_depth(copy: BaseException | None) -> int:
    depth = 0
    while copy is not None:
        depth += 1
        copy = copy.__cause__
    return depth


def test_scrubbed_copies_at_most_sixteen_links_and_stops_on_cycles() -> None:
    assert copied_depth(scrubbed(chain(16))) == 16
    assert copied_depth(scrubbed(chain(40))) == 16
    first, second = ValueError("a"), ValueError("b")
    first.__context__, second.__context__ = second, first  # a cycle (try/except can make one)
    copy = scrubbed(first)
    depth = 0
    while copy is not None:
        depth += 1
        copy = copy.__context__
    assert depth == 16


def test_scrubbed_keeps_context_and_its_suppression() -> None:
    try:
        try:
            raise KeyError("first")
        except KeyError:
            raise ValueError("while handling") from None
    except ValueError as exc:
        suppressed = scrubbed(exc)
    assert suppressed is not None
    assert suppressed.__suppress_context__
    assert suppressed.__context__ is None
    try:
        try:
            raise KeyError("first")
        except KeyError:
            raise ValueError("while handling")  # noqa: B904  (the implicit context is the point)
    except ValueError as exc:
        implicit = scrubbed(exc)
    assert implicit is not None
    assert not implicit.__suppress_context__
    assert isinstance(implicit.__context__, RedactedError)
    assert implicit.__context__.type_name == "KeyError"


def test_scrubbed_leaves_a_redacted_error_as_it_is() -> None:
    from cloudshards.redact import caused_by

    copy = scrubbed(FileNotFoundError("gone"))
    assert scrubbed(copy) is copy
    error = ShardOpenError("not found", url="s3://b/k.tar")
    error.__cause__ = scrubbed(copy)
    assert caused_by(error, FileNotFoundError)


def test_raise_redacted_of_the_error_itself_adds_no_cause() -> None:
    error = ValueError("ours")
    with pytest.raises(ValueError, match="ours") as info:
        raise_redacted(error, error)
    assert info.value is error
    assert error.__cause__ is None


def test_unraised_exception_in_a_backend_log_is_redacted(backend_log: io.StringIO) -> None:
    # exc_info=<an exception never raised>: no traceback, the text still needs redacting.
    failure = OSError(f"403 for url http://alice:{SECRET}@host/x.tar")
    logging.getLogger("s3fs").debug("failed", exc_info=failure)
    text = backend_log.getvalue()
    assert "403 for url http://<redacted>@host/x.tar" in text
    assert SECRET not in text


def test_stack_info_in_a_backend_log_is_redacted(backend_log: io.StringIO) -> None:
    # The stack's source lines quote this call, URL and all.
    logging.getLogger("s3fs").debug("x", stack_info=True)  # http://alice:hunter2@host/x.tar
    text = backend_log.getvalue()
    assert "Stack (most recent call last)" in text
    assert "http://<redacted>@host/x.tar" in text
    assert SECRET not in text


def test_filters_redact_when_another_library_replaces_the_record_factory(
    backend_log: io.StringIO,
) -> None:
    """The second layer: a filter on every backend logger, for a factory that does not chain
    ours. Children created after an install get one at the next install; other loggers none."""
    from cloudshards.redact import RedactingFilter

    child = logging.getLogger(f"botocore.cloudshards_test_{id(backend_log)}")
    mine = logging.getLogger(f"my_training_{id(backend_log)}")
    install_log_redaction()
    factory = logging.getLogRecordFactory()
    install_log_redaction()
    assert logging.getLogRecordFactory() is factory  # idempotent: not wrapped twice
    assert any(isinstance(f, RedactingFilter) for f in child.filters)
    assert not any(isinstance(f, RedactingFilter) for f in mine.filters)
    logging.setLogRecordFactory(logging.LogRecord)
    try:
        for log in (logging.getLogger("botocore"), child):
            log.debug("GET https://alice:%s@host/x.tar", SECRET)
    finally:
        logging.setLogRecordFactory(factory)
    text = backend_log.getvalue()
    assert text.count("GET https://<redacted>@host/x.tar") == 2
    assert SECRET not in text


def test_redacting_filter_on_any_logger() -> None:
    from cloudshards.redact import RedactingFilter

    install_log_redaction()
    # logging.makeLogRecord (log servers, queue listeners) calls the factory without a name:
    # the redacting factory used to raise AttributeError there.
    record = logging.makeLogRecord({"msg": "GET %s", "args": (f"http://a:{SECRET}@h/x",)})
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "GET http://<redacted>@h/x"


@pytest.mark.parametrize(
    ("command", "kept"),
    [
        (f"HF_TOKEN={SECRET} curl -s -f http://h/a.tar", "curl -s -f http://h/a.tar"),
        (f"curl -u alice:{SECRET} http://h/a.tar", "http://h/a.tar"),
        (f"curl --oauth2-bearer {SECRET} http://h/a.tar", "http://h/a.tar"),
        (f"tool --password {SECRET} --api-key={SECRET} s3://b/a.tar", "s3://b/a.tar"),
        (f"aws s3 cp --sse-c-key {SECRET} s3://b/a.tar -", "s3://b/a.tar -"),
        (f"gsutil -o Credentials:gs_oauth2_refresh_token={SECRET} cat gs://b/a.tar", "gsutil"),
        (f"curl -H 'Authorization: Bearer {SECRET}' http://h/a.tar", "curl -H"),
        (f"curl -s https://h/a.tar?sig={SECRET}", "curl -s https://h/a.tar"),
    ],
)
def test_pipe_commands_keep_the_shard_and_lose_their_secrets(command: str, kept: str) -> None:
    """With allow_pipe=True a failing command is named in errors and logs: what it reads
    stays, its credentials (variables, options, headers, signed queries) do not."""
    shown = redact_url(f"pipe:{command}")
    assert SECRET not in shown
    assert kept in shown
    assert shown.startswith("pipe:")


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (f"curl -ualice:{SECRET} http://h/a.tar", "curl -u<redacted> http://h/a.tar"),
        (f"curl -sSfualice:{SECRET} http://h/a.tar", "curl -sSfu<redacted> http://h/a.tar"),
        (f"curl -sSfu alice:{SECRET} http://h/a.tar", "curl -sSfu <redacted> http://h/a.tar"),
        (f"curl --user alice:{SECRET} http://h/a.tar", "curl --user <redacted> http://h/a.tar"),
        (
            f"wget --user=alice --password={SECRET} --http-password={SECRET} http://h/a.tar",
            "wget --user=<redacted> --password=<redacted> --http-password=<redacted> http://h/a.tar",
        ),
        (
            f"curl -H 'PRIVATE-TOKEN: {SECRET}' http://h/a.tar",
            "curl -H 'PRIVATE-TOKEN: <redacted>' http://h/a.tar",
        ),
        (
            f'curl --header "Cookie: session={SECRET}" http://h/a.tar',
            'curl --header "Cookie: <redacted>" http://h/a.tar',
        ),
        (
            f"wget --header='X-Api: {SECRET}' http://h/a.tar",
            "wget --header='X-Api: <redacted>' http://h/a.tar",
        ),
        (f"curl -HX-Api:{SECRET} http://h/a.tar", "curl -HX-Api: <redacted> http://h/a.tar"),
        (f"curl -b session={SECRET} http://h/a.tar", "curl -b <redacted> http://h/a.tar"),
        (f"curl --cookie 's={SECRET}' http://h/a.tar", "curl --cookie '<redacted>' http://h/a.tar"),
        (
            f'curl -H "Authorization: Bearer {SECRET}" http://h/a.tar',
            'curl -H "Authorization: <redacted>" http://h/a.tar',
        ),
        (f"get --bearer={SECRET} http://h/a.tar", "get --bearer=<redacted> http://h/a.tar"),
        (f"echo Bearer {SECRET}", "echo Bearer <redacted>"),
        (
            f"sh -c 'curl -u a:{SECRET} http://h/a.tar | zcat'",
            "sh -c 'curl -u <redacted> http://h/a.tar | zcat'",
        ),
        # Nothing secret: -p (curl's --proxytunnel, wget's --page-requisites) takes no value.
        ("curl -p -A 'agent 1.0' --user-agent x http://h/a.tar", None),
    ],
)
def test_pipe_commands_mask_curl_and_wget_credentials(command: str, shown: str | None) -> None:
    """Every form curl and wget take credentials in: -u attached or not, --user=, headers
    (their name stays), cookies, bearer tokens, and commands inside sh -c '...'."""
    assert redact_url(f"pipe:{command}") == f"pipe:{shown or command}"


def test_a_failing_pipe_command_shows_no_header_or_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import cloudshards as wds

    command = f"false -uALICE:{SECRET} -H 'PRIVATE-TOKEN: {SECRET}' https://h/a.tar"
    dataset = wds.WebDataset(f"pipe:{command}", shardshuffle=False, allow_pipe=True)
    with (
        caplog.at_level(logging.DEBUG, logger="cloudshards"),
        pytest.raises(ShardOpenError) as info,
    ):
        list(dataset)
    assert "opened pipe:false" in caplog.text
    assert "false -u<redacted> -H 'PRIVATE-TOKEN: <redacted>' https://h/a.tar" in str(info.value)
    assert SECRET not in "".join(traceback.format_exception(info.value)) + caplog.text


@pytest.mark.parametrize(
    "text",
    [
        f"HF_TOKEN={SECRET}",
        f"GITHUB_TOKEN: {SECRET}",
        f"sas_token={SECRET}",
        f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey={SECRET}",
        f"{{'account_key': '{SECRET}'}}",
    ],
)
def test_fields_named_after_a_secret_are_masked(text: str) -> None:
    assert SECRET not in redact_text(text)


def test_a_failing_pipe_command_shows_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    import cloudshards as wds

    dataset = wds.WebDataset(f"pipe:HF_TOKEN={SECRET} exit 7", shardshuffle=False, allow_pipe=True)
    with (
        caplog.at_level(logging.DEBUG, logger="cloudshards"),
        pytest.raises(ShardOpenError) as info,
    ):
        list(dataset)
    shown = "".join(traceback.format_exception(info.value)) + caplog.text + repr(info.value)
    shown += str(pickle.loads(pickle.dumps(info.value)))
    assert "HF_TOKEN=<redacted> exit 7" in str(info.value)
    assert SECRET not in shown


@pytest.mark.parametrize(
    "line",
    [
        # s3fs strips "s3://" and logs (or raises with) the bucket as the URL gave it.
        "Get directory listing page for alice:hunter2@bkt/train",
        "CALL: get_object - () - {'Bucket': 'alice:hunter2@bkt', 'Key': 'a.tar'}",
        'Invalid bucket name "alice:hunter2@bkt": Bucket name must match the regex',
    ],
)
def test_redact_text_masks_user_info_without_a_scheme(line: str) -> None:
    assert SECRET not in redact_text(line)
    assert "<redacted>@bkt" in redact_text(line)


@pytest.mark.parametrize(
    "url",
    [
        "s3://alice:hunter2@bkt/train-{0..1}.tar",
        "gs://hunter2@bkt/a.tar",
        "s3a://a:hunter2@b/x.tar",
    ],
)
def test_bucket_urls_with_credentials_are_refused_before_any_backend(url: str) -> None:
    import cloudshards as wds
    from cloudshards.urls import resolve

    with pytest.raises(ConfigError, match="storage_options") as info:
        next(iter(wds.WebDataset(url, shardshuffle=False)))
    assert SECRET not in "".join(traceback.format_exception(info.value))
    with pytest.raises(ConfigError, match="not credentials") as info:
        resolve(url.replace("{0..1}", "0"))
    assert SECRET not in str(info.value)


def test_a_directory_url_is_refused_without_its_password() -> None:
    import cloudshards as wds

    with pytest.raises(ConfigError, match="looks like a directory") as info:
        wds.WebDataset("https://alice:hunter2@host/train/")
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("mark", ["?", "/", "#"])
def test_a_password_that_ends_the_authority_is_refused_without_a_fragment_of_it(mark: str) -> None:
    """An unencoded '?', '/' or '#' in a password ends the URL's authority there, so the
    password's start became the port, and the backend's parse error quoted it ('Pw')."""
    import cloudshards as wds

    url = f"http://alice:Pw{mark}Q9zz@127.0.0.1:9/ok.tar"
    with pytest.raises(ConfigError, match="percent-encoded") as info:
        list(wds.WebDataset(url, shardshuffle=False, retries=0))
    text = "".join(traceback.format_exception(info.value))
    assert "Pw" not in text
    assert "Q9zz" not in text
    assert "127.0.0.1:9/ok.tar" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/ok.tar?next=user:pw@example.com",
        "http://[::1]:9/ok.tar",
        "https://host/a.tar#x:y@z",
        "github://org:repo@main/a.tar",
        "http://localhost:{8000..8001}/shard-{000..001}.tar",
        "pipe:curl -s http://localhost:$PORT/x.tar",
    ],
)
def test_urls_with_a_numeric_or_no_port_are_not_refused(url: str) -> None:
    from cloudshards.urls import expand_urls

    assert expand_urls(url)  # no ConfigError
