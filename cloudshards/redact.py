"""Redaction of credentials and signed-URL query strings from anything we print or log.

Three places a secret could leak, each handled here once:
- text: :func:`redact_url` / :func:`redact_text` for the messages cloudshards writes;
- exception chains: :func:`scrubbed` replaces a backend's exception (whose text and attributes
  hold the raw URL) by a :class:`RedactedError` copy before it becomes a ``__cause__``;
- the storage backends' own loggers: :func:`install_log_redaction` puts a
  :class:`RedactingFilter` on fsspec's, s3fs's, gcsfs's, aiohttp's, botocore's ... loggers.
"""

from __future__ import annotations

import logging
import re
import shlex
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "BACKEND_LOGGERS",
    "RedactedError",
    "RedactingFilter",
    "caused_by",
    "install_log_redaction",
    "raise_redacted",
    "redact_text",
    "redact_url",
    "scrubbed",
]

_URL_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
# A URL in quotes ends at its closing quote ('s3://b/k' in a repr); any other URL ends only at
# white space or <>": a quote is legal unencoded in a password or a query string
# (filename='a.tar'&Signature=...), and stopping there would leave the rest in clear.
_QUOTED_URL_IN_TEXT = re.compile(rf"(['\"])({_SCHEME}[^\s<>]*?)(?=\1|[\s<>]|$)")
_URL_IN_TEXT = re.compile(rf"(?<![\w+.\-'\"]){_SCHEME}[^\s\"<>]+")
# "user:" at the start of the authority that is not "host:port".
_USER_COLON = re.compile(r"[^/?#@:]*:")
_HOST_PORT = re.compile(r"[^/?#@:]*:\d*(?:[/?#]|$)")
_MASK = "<redacted>"
# "user:secret@host" with no scheme before it: a backend that strips ``s3://`` logs the bucket
# as "key:secret@bucket". Starts a word (not inside a URL's path or host:port).
_BARE_USERINFO = re.compile(r"(?<![\w.+\-/:@%])[^\s/:@'\"<>]+:[^\s/@'\"<>]+@(?=\w)")

# Header and field names whose values are secrets wherever they appear in free text: HTTP
# headers in a backend's debug log (botocore prints the signed request, Authorization included;
# its canonical request lists x-amz-security-token), credential fields in a repr.
# Credential names in CamelCase or with another separator (STS, instance metadata, botocore's
# credential dicts): named one by one, as words like "tokenizer=" or "max_tokens:" are not.
_COMPOUND = (
    r"secret_?access_?key|secret_?key|session_?token|security_?token|access_?token"
    r"|refresh_?token|auth_?token|bearer_?token|id_?token|api_?token|client_?secret"
    r"|api_?key|private_?key"
)
_MASKED_FIELDS = (
    r"authorization|proxy-authorization|cookie|set-cookie|x-amz-security-token|x-amz-signature"
    r"|x-amz-credential|x-goog-signature|x-goog-credential|x-api-key|aws_secret_access_key"
    r"|aws_session_token|secret_access_key|session_token|secret|password|passwd"
    r"|access_token|refresh_token|id_token|client_secret|private_key|sig|token|signature"
    r"|key-pair-id|policy|credential|accountkey|sharedaccesskey"
    # Variables and fields that end in a secret's name: HF_TOKEN, sas_token, account_key.
    r"|\w+_(?:token|secret|password|passwd|key)"
    rf"|{_COMPOUND}"
)
# name, separator, then a quoted value (masked to its closing quote) ...
_QUOTED_SECRET = re.compile(rf"(?i)(?<![\w-])({_MASKED_FIELDS})(['\"]?\s*[:=]\s*b?)(['\"])(.*?)\3")
# ... or an unquoted one (masked to the end of the line, or the next field of a query string).
_BARE_SECRET = re.compile(rf"(?i)(?<![\w-])({_MASKED_FIELDS})(\s*[:=]\s*)(?![\s'\"<])([^\r\n&]+)")
# ... or an XML element (STS and IMDS answers, which botocore logs at DEBUG).
_XML_SECRET = re.compile(rf"(?i)<({_COMPOUND}|token)>[^<]*</\1>")


def redact_url(url: str) -> str:
    """Return ``url`` without user info (``user:secret@``) and with any query string masked.

    Signed URLs (S3 presigned, GCS signed) carry their secrets in the query string, so the
    whole query is replaced by ``?<redacted>``; the fragment is dropped for the same reason. A
    password holding an unencoded ``/``, ``#``, ``?`` or ``@`` is still masked: when the text
    after ``scheme://`` starts like ``user:`` (not ``host:port``), everything up to the last
    ``@`` is treated as user info (when in doubt, hide more).
    """
    if url.startswith("pipe:"):
        return "pipe:" + _redact_command(url[len("pipe:") :])
    if _URL_START.match(url) is None:
        # Not a URL itself (a local path): redact URLs embedded in it.
        return redact_text(url)
    scheme, rest = url.split("://", 1)
    userinfo = ""
    if "@" in rest and _USER_COLON.match(rest) and not _HOST_PORT.match(rest):
        userinfo = _MASK + "@"
        rest = rest[rest.rindex("@") + 1 :]
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError:
        return f"{scheme}://{_MASK}"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = _MASK + "@" + netloc.rsplit("@", 1)[1]
    elif userinfo:
        netloc = userinfo + netloc
    if netloc == parts.netloc and not userinfo and not parts.query and not parts.fragment:
        return url  # nothing secret: unchanged (urlunsplit would turn memory:///x into memory:/x)
    query = _MASK if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


# Long options whose value is a secret: curl's --user, --proxy-user, --cert (file:password),
# --cookie, --oauth2-bearer; wget's --user=, --http-password=...; any named like a secret
# (--api-key=K, --sse-c-key K); and --header, whose value keeps the header's name.
_SECRET_OPTION = re.compile(
    r"(?i)^--(?:(?:http-|ftp-|proxy-|tls)?user|cert|(?:proxy-)?header"
    r"|.*(?:token|secret|pass|key|auth|bearer|credential|cookie|signature).*)$"
)
# curl's short ones (-u, -U, -E, -b, -H), alone or last in a group, the value attached or not:
# -u U:P, -uU:P, -sSfuU:P. Not -p: curl's and wget's take no value.
_SHORT_SECRET_OPTION = re.compile(r"^(-[A-Za-z]*?[uUEbH])(.*)$", re.DOTALL)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# A shell word: unquoted text, backslash escapes and quoted strings (an unclosed quote runs on
# to the end), so that -H 'PRIVATE-TOKEN: T' is one word.
_SHELL_WORD = re.compile(r"""(?:[^\s'"\\]+|\\.?|'[^']*'?|"(?:[^"\\]|\\.)*"?)+""", re.DOTALL)
_BEARER = re.compile(r"(?i)(\bbearer\s+)(?!<)[^\s'\"]+")


def _unquote(word: str) -> str:
    try:
        return "".join(shlex.split(word))
    except ValueError:  # an unclosed quote: its text runs on to the end
        return word.replace("'", "").replace('"', "")


def _mask_value(option: str, value: str) -> str:
    """The value of a secret ``option``: a header (-H, --header) keeps its name, nothing else."""
    header, colon, _ = value.partition(":")
    is_header = option.endswith("header") or (option.endswith("H") and option[1] != "-")
    return f"{header}: {_MASK}" if is_header and colon else _MASK


def _redact_command(command: str) -> str:
    """A ``pipe:`` command for messages: its program and arguments (which name the shard),
    with the values of leading variable assignments, of secret options and of headers masked,
    a command in a quoted word (``sh -c '...'``) redacted alike, and every embedded URL,
    ``Bearer`` token and ``name=secret`` redacted as in :func:`redact_text`."""
    out, end, program_seen, option = [], 0, False, ""
    for match in _SHELL_WORD.finditer(command):
        out.append(command[end : match.start()])
        end, word = match.end(), match.group()
        value = _unquote(word)
        quote = next((char for char in word if char in "'\""), "")
        name, eq, rest = value.partition("=")
        short = None if value.startswith("--") else _SHORT_SECRET_OPTION.match(value)
        if option:
            word, option = quote + _mask_value(option, value) + quote, ""
        elif not program_seen and _ASSIGNMENT.match(value):
            word = f"{name}={_MASK}"
        elif _SECRET_OPTION.match(name) and eq:
            word = f"{name}={quote}{_mask_value(name, rest)}{quote}"
        elif _SECRET_OPTION.match(value):
            option = value
        elif short and short.group(2):
            word = short.group(1) + quote + _mask_value(short.group(1), short.group(2)) + quote
        elif short:
            option = value
        elif value != word and any(char.isspace() for char in value):
            word = quote + _redact_command(value) + quote
        program_seen = program_seen or not _ASSIGNMENT.match(value)
        out.append(word)
    out.append(command[end:])
    return _BEARER.sub(lambda m: m.group(1) + _MASK, redact_text("".join(out)))


def redact_text(text: str) -> str:
    """Redact secrets inside free text (a backend's error message, a debug log line).

    Every URL is passed through :func:`redact_url`, and the values of secret headers and
    fields (``Authorization: ...``, ``'x-amz-security-token': '...'``, ``password=...``) are
    masked. Everything else is left as it was.
    """
    text = _QUOTED_URL_IN_TEXT.sub(lambda m: m.group(1) + redact_url(m.group(2)), text)
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    text = _BARE_USERINFO.sub(_MASK + "@", text)
    text = _QUOTED_SECRET.sub(
        lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}{_MASK}{m.group(3)}", text
    )
    text = _XML_SECRET.sub(lambda m: f"<{m.group(1)}>{_MASK}</{m.group(1)}>", text)
    return _BARE_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{_MASK}", text)


class RedactedError(Exception):
    """A backend's exception with every secret removed, kept as the ``__cause__`` of ours.

    The backend's own exception object holds the raw URL (in its text, and in attributes such
    as aiohttp's ``request_info``), and a chained cause is printed by every traceback, by
    DataLoader's re-raise from a worker and by log collectors. This copy keeps what helps
    debugging (the type's name, the redacted message, the errno or HTTP status and the
    traceback's frames) and nothing else.

    Attributes:
        type_name: The original exception's qualified type name, e.g.
            ``"aiohttp.client_exceptions.ClientResponseError"``.
        original_type: The original exception's class (a class holds no secret), so code can
            still ask what kind of failure it was: see :func:`caused_by`. None after pickling.
        errno: The original ``errno``, when it had one.
        status: The original HTTP status (``status`` or ``code``), when it had one.
    """

    def __init__(
        self,
        type_name: str,
        message: str,
        *,
        errno: int | None = None,
        status: int | None = None,
        original_type: type[BaseException] | None = None,
    ) -> None:
        self.type_name = type_name
        self.original_type = original_type
        self.errno = errno
        self.status = status
        super().__init__(f"{type_name}: {message}" if message else type_name)

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable across DataLoader worker boundaries.
        return (_rebuild_redacted, (self.type_name, str(self), self.errno, self.status))


def _rebuild_redacted(
    type_name: str, text: str, errno: int | None, status: int | None
) -> RedactedError:
    error = RedactedError(type_name, "", errno=errno, status=status)
    error.args = (text,)
    return error


_MAX_CHAIN = 16


def scrubbed(exc: BaseException | None, _depth: int = 0) -> RedactedError | None:
    """Return a :class:`RedactedError` copy of ``exc`` and of its whole cause/context chain.

    Use it wherever a foreign exception would become the cause of ours:
    ``raise ShardOpenError(...) from scrubbed(exc)``. The copy keeps ``exc``'s traceback
    (frames and source lines, no values).
    """
    if exc is None or _depth >= _MAX_CHAIN:
        return None
    if isinstance(exc, RedactedError):
        return exc
    kind = type(exc)
    module = kind.__module__
    type_name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    try:
        message = redact_text(str(exc))
    except Exception:  # a broken __str__ of a foreign exception must not hide ours
        message = "<unprintable>"
    errno = getattr(exc, "errno", None)
    status = getattr(exc, "status", None)
    if status is None:
        status = getattr(exc, "code", None)
    copy = RedactedError(
        type_name,
        message,
        errno=errno if isinstance(errno, int) else None,
        status=status if isinstance(status, int) else None,
        original_type=kind,
    )
    copy.__traceback__ = exc.__traceback__
    copy.__cause__ = scrubbed(exc.__cause__, _depth + 1)
    if not exc.__suppress_context__:
        copy.__context__ = scrubbed(exc.__context__, _depth + 1)
    copy.__suppress_context__ = exc.__suppress_context__
    return copy


def caused_by(error: BaseException, *kinds: type[BaseException]) -> bool:
    """Whether ``error``'s cause is one of ``kinds`` (an instance, or a redacted copy of one).

    What to ask of an error raised through :func:`raise_redacted`, instead of
    ``isinstance(error.__cause__, ...)``, which only ever sees a :class:`RedactedError`.
    """
    cause = error.__cause__
    if isinstance(cause, RedactedError):
        return cause.original_type is not None and issubclass(cause.original_type, kinds)
    return isinstance(cause, kinds)


#: The loggers of the storage stacks cloudshards drives; their children are covered too.
BACKEND_LOGGERS = (
    "fsspec",
    "s3fs",
    "gcsfs",
    "aiohttp",
    "aiobotocore",
    "botocore",
    "boto3",
    "urllib3",
    "requests",
    "google",
    "google_auth_httplib2",
    "obstore",
)


class RedactingFilter(logging.Filter):
    """Redact URLs and secret headers in the records of the loggers it is installed on.

    It only rewrites a record whose text holds a secret (the message is then stored already
    formatted); every record still passes, so nothing else is hidden.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


def redact_record(record: logging.LogRecord) -> None:
    """Rewrite ``record`` in place when its message, traceback or stack holds a secret."""
    try:
        message = record.getMessage()
    except Exception:  # a broken record is the logging module's business, not ours
        return
    clean = redact_text(message)
    if clean != message:
        record.msg = clean
        record.args = None
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        # Formatter.format uses a record's exc_text when set: give it the redacted one.
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        record.exc_text = redact_text(text)
    if record.stack_info:
        record.stack_info = redact_text(record.stack_info)


_FILTER = RedactingFilter()
_installed: set[str] = set()
_install_lock = threading.Lock()
_seen_loggers = -1


def _is_backend(name: str | None) -> bool:
    # None: logging.makeLogRecord() builds its record nameless, then sets the fields.
    return name is not None and name.split(".", 1)[0] in BACKEND_LOGGERS


def _redacting_factory(
    previous: Callable[..., logging.LogRecord],
) -> Callable[..., logging.LogRecord]:
    def make_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if _is_backend(record.name):
            redact_record(record)
        return record

    make_record._cloudshards_redacting = True  # type: ignore[attr-defined]
    return make_record


def install_log_redaction() -> None:
    """Redact what the storage backends log (idempotent, cheap; cloudshards calls it itself).

    Two layers, because a logger's filter sees only the records logged on that very logger
    (not its children's, nor those of loggers created later, as botocore creates some on its
    first request): the log record factory, wrapped to redact records of
    :data:`BACKEND_LOGGERS` and their children whatever logger made them, and a
    :class:`RedactingFilter` on every such logger that exists, in case another library later
    replaces the factory without chaining ours. Records of any other logger are untouched.
    """
    global _seen_loggers
    manager = logging.Logger.manager
    with _install_lock:
        factory = logging.getLogRecordFactory()
        if not getattr(factory, "_cloudshards_redacting", False):
            logging.setLogRecordFactory(_redacting_factory(factory))
        if len(manager.loggerDict) == _seen_loggers:
            return
        names = [name for name in list(manager.loggerDict) if _is_backend(name)]
        for name in (*BACKEND_LOGGERS, *names):
            if name not in _installed:
                logging.getLogger(name).addFilter(_FILTER)
                _installed.add(name)
        _seen_loggers = len(manager.loggerDict)


def raise_redacted(error: BaseException, cause: BaseException) -> NoReturn:
    """Raise ``error`` from a redacted copy of ``cause``, leaving no raw backend error reachable.

    ``raise error from scrubbed(cause)`` alone hides the raw exception from printers, but
    still stores it as ``error.__context__``; this also drops that reference, so code that
    walks the chain by hand (a log collector, a test) finds no secret either.
    """
    if error is cause:
        raise error
    try:
        raise error from scrubbed(cause)
    finally:
        error.__context__ = None
