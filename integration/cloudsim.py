"""Cloud simulator: an aiohttp reverse proxy that makes a local server behave like object storage.

Put it in front of nginx, moto or fake-gcs-server. It forwards every request unchanged (method,
raw path and query, every header including Host, so S3 SigV4 signatures stay valid, and the body)
and streams the answer back, adding on demand: first-byte latency and jitter, a per-connection
bandwidth cap or one shared by every answer, injected error answers (503 SlowDown), bodies cut
mid-way, stalls, and a server that ignores Range. Knobs are ``SimConfig`` fields, changeable at
runtime through ``POST /__cloudsim__/config`` (JSON); ``GET /__cloudsim__/stats`` returns the
counters.

In-process: ``with CloudSim(upstream, latency_s=0.03).start() as sim: ... sim.url``.
As a process (no shared GIL): ``python integration/cloudsim.py --upstream URL --port 0 [knobs]``
prints its URL on stdout and runs until SIGTERM/SIGINT; ``CloudSimProcess`` wraps that.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import dataclasses
import json
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from yarl import URL

__all__ = ["CONTROL_PREFIX", "CloudSim", "CloudSimProcess", "SimConfig", "SimStats", "main"]

CONTROL_PREFIX = "/__cloudsim__"
# Hop-by-hop headers (RFC 9110 7.6.1) are per connection; Expect is answered by this proxy.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te"}
_HOP_BY_HOP |= {"trailer", "transfer-encoding", "upgrade", "expect"}
_S3_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}
_CUTTABLE = (200, 206)
_R = TypeVar("_R", bound=web.StreamResponse)


@dataclass(frozen=True)
class SimConfig:
    """The knobs. Every-Nth counting restarts at each ``configure``; 0 means off."""

    latency_s: float = 0.0  # added before forwarding each request (first-byte delay)
    jitter_s: float = 0.0  # plus a uniform random delay in [0, jitter_s]
    bandwidth_bps: float = 0.0  # bytes/s per response body (one connection); 0 = unlimited
    # bytes/s of all response bodies together (one shared bottleneck: a server's disk or
    # CPU, a local network); 0 = unlimited
    total_bandwidth_bps: float = 0.0
    fail_every_n: int = 0  # every Nth request with a method in fail_methods gets fail_status
    fail_status: int = 503  # S3-style XML body for signed S3 requests, JSON otherwise
    fail_methods: tuple[str, ...] = ("GET",)
    cut_every_n: int = 0  # every Nth forwarded GET: headers + cut_after_bytes, then disconnect
    cut_after_bytes: int = 0  # where cuts and stalls happen (at most Content-Length - 1)
    cut_all: bool = False  # cut every GET
    # every GET whose answer carries this byte of the object is cut just before it (a byte the
    # store never delivers, however often asked); -1 = off
    cut_at_offset: int = -1
    stall_at_offset: bool = False  # with cut_at_offset: pause stall_s before it, then go on
    cut_mode: str = "close"  # "close": FIN (client sees a short body); "reset": TCP RST
    stall_every_n: int = 0  # every Nth forwarded GET pauses stall_s at cut_after_bytes
    stall_s: float = 30.0
    ignore_range: bool = False  # drop Range/If-Range: upstream answers 200 + the whole body
    ignore_if_match: bool = False  # drop If-Match, as s3rver and Python's http.server ignore it
    chunked: bool = False  # answers without Content-Length (chunked), as a gzipping nginx sends
    match: str = ""  # regex on path?query: faults only hit requests it matches ("" = all)
    rate_limit_rps: float = 0.0  # GETs admitted per second (a sliding second); the rest: 503

    def replace(self, **knobs: Any) -> SimConfig:
        """Return a copy with ``knobs`` changed; ValueError for an unknown or invalid knob."""
        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(self)}
        values: dict[str, Any] = {}
        for name, value in knobs.items():
            if name not in defaults:
                raise ValueError(f"unknown knob {name!r}; known: {', '.join(defaults)}")
            kind = type(defaults[name])
            if kind is tuple:
                parts = value.split(",") if isinstance(value, str) else value
                values[name] = tuple(str(part).strip().upper() for part in parts if part)
            elif kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, not {value!r}")
                values[name] = value
            else:
                values[name] = kind(value)
        new = dataclasses.replace(self, **values)
        if new.cut_mode not in ("close", "reset"):
            raise ValueError(f"cut_mode must be 'close' or 'reset', not {new.cut_mode!r}")
        re.compile(new.match)
        return new

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


@dataclass
class SimStats:
    """Counters since start or ``reset_stats`` (control API requests are not counted)."""

    requests: int = 0
    gets: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
    by_path: dict[str, int] = field(default_factory=dict)  # raw path, no query
    by_status: dict[str, int] = field(default_factory=dict)  # status sent to the client
    bytes_sent: int = 0  # body bytes relayed from upstream to clients (not injected errors)
    failures: int = 0  # injected error answers
    cuts: int = 0  # bodies cut short
    stalls: int = 0
    ranges_ignored: int = 0  # Range headers dropped by ignore_range
    if_match_ignored: int = 0  # If-Match headers dropped by ignore_if_match
    upstream_errors: int = 0  # upstream unreachable (502) or its body broke mid-way
    client_disconnects: int = 0  # the client went away before the body was sent
    throttled: int = 0  # GETs answered 503 SlowDown by the rate limit
    gets_in_flight_max: int = 0  # most GETs being answered at once

    @property
    def faults(self) -> int:
        """Injected faults: error answers plus cuts."""
        return self.failures + self.cuts

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SimStats:
        return cls(**data)


def _error_body(request: web.Request, status: int, seq: int) -> tuple[str, str]:
    """Return (content type, body) of an injected error, S3-style for signed S3 requests."""
    auth = request.headers.get("Authorization", "")
    is_s3 = auth.startswith(("AWS4-", "AWS ")) or "X-Amz-Signature" in request.query_string
    if is_s3 or any(name.lower().startswith("x-amz-") for name in request.headers):
        code, message = _S3_ERRORS.get(status, ("ServiceUnavailable", "Service unavailable."))
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{request.path}</Resource><RequestId>cloudsim-{seq}</RequestId></Error>"
        )
        return "application/xml", body
    error = {"code": status, "message": f"cloudsim injected error #{seq}"}
    error["errors"] = [{"reason": "backendError", "message": error["message"]}]
    return "application/json", json.dumps({"error": error})


class CloudSim:
    """The proxy: ``start()`` runs it on its own thread and event loop (``stop()`` ends both);
    ``start_async()``/``stop_async()`` run it on the caller's loop instead."""

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        **knobs: Any,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.host, self.port = host, port
        self._config = SimConfig().replace(**knobs)
        self._stats = SimStats()
        self._link_free = 0.0  # when the shared bottleneck is free again (loop time)
        self._seq = {"fail": 0, "cut": 0, "stall": 0}
        self._admitted: collections.deque[float] = collections.deque()  # rate limit's second
        self._gets_in_flight = 0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._url: str | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------- public API
    @property
    def url(self) -> str:
        """``http://host:port`` of the proxy; use it as endpoint_url / base URL."""
        if self._url is None:
            raise RuntimeError("the simulator is not running")
        return self._url

    @property
    def config(self) -> SimConfig:
        return self._config

    def configure(self, **knobs: Any) -> SimConfig:
        """Change knobs (thread-safe); every-Nth counting restarts."""
        with self._lock:
            self._config = self._config.replace(**knobs)
            self._seq = dict.fromkeys(self._seq, 0)
            return self._config

    def stats(self) -> SimStats:
        """A snapshot of the counters (thread-safe)."""
        with self._lock:
            return copy.deepcopy(self._stats)

    def reset_stats(self) -> None:
        """Zero the counters (every-Nth counting goes on: ``configure()`` restarts it)."""
        with self._lock:
            self._stats = SimStats()

    async def start_async(self) -> str:
        """Bind and serve on the running loop; return the URL."""
        app = web.Application()
        app.router.add_get(f"{CONTROL_PREFIX}/stats", self._get_stats)
        app.router.add_route("*", f"{CONTROL_PREFIX}/config", self._config_endpoint)
        app.router.add_post(f"{CONTROL_PREFIX}/reset", self._reset_endpoint)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            read_bufsize=1 << 20,
        )
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._url = f"http://{self.host}:{self.port}"
        return self._url

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._url = None

    def start(self, timeout_s: float = 30.0) -> CloudSim:
        """Run on a new thread with its own event loop; return self once bound."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cloudsim", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start_async(), self._loop).result(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving, close every connection, end the thread; idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.stop_async(), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> CloudSim:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------------- control API
    async def _get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats().to_json())

    async def _config_endpoint(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                knobs = await request.json()
                if not isinstance(knobs, dict):
                    raise ValueError("the body must be a JSON object of knobs")
                self.configure(**knobs)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(self._config.to_json())

    async def _reset_endpoint(self, request: web.Request) -> web.Response:
        self.reset_stats()
        return web.json_response({})

    # -------------------------------------------------------------------- the proxy
    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def _next(self, kind: str, every: int) -> bool:
        """Advance an every-Nth counter (under the lock); True on multiples of ``every``."""
        self._seq[kind] += 1
        return self._seq[kind] % every == 0

    def _admit(self, request: web.Request, cfg: SimConfig) -> tuple[bool, bool, bool, int]:
        """Count the request and decide its fate: (fail, cut, stall, sequence number)."""
        method, path = request.method, request.rel_url.raw_path
        hit = not cfg.match or re.search(cfg.match, request.raw_path) is not None
        with self._lock:
            st = self._stats
            st.requests += 1
            st.gets += method == "GET"
            st.by_method[method] = st.by_method.get(method, 0) + 1
            st.by_path[path] = st.by_path.get(path, 0) + 1
            fail = hit and cfg.fail_every_n > 0 and method in cfg.fail_methods
            fail = fail and self._next("fail", cfg.fail_every_n)
            get = hit and not fail and method == "GET"
            cut = get and (
                cfg.cut_all or (cfg.cut_every_n > 0 and self._next("cut", cfg.cut_every_n))
            )
            stall = get and cfg.stall_every_n > 0 and self._next("stall", cfg.stall_every_n)
            if method == "GET" and cfg.rate_limit_rps > 0 and not fail:
                now, admitted = time.monotonic(), self._admitted
                while admitted and admitted[0] <= now - 1.0:
                    admitted.popleft()
                if len(admitted) >= cfg.rate_limit_rps:
                    st.throttled += 1
                    fail, cut, stall = True, False, False
                else:
                    admitted.append(now)
            return fail, cut, stall, st.requests

    def _sent(self, response: _R) -> _R:
        """Count the status of an answer about to be sent."""
        with self._lock:
            key = str(response.status)
            self._stats.by_status[key] = self._stats.by_status.get(key, 0) + 1
        return response

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET":
            return await self._answer(request)
        with self._lock:
            self._gets_in_flight += 1
            most = max(self._stats.gets_in_flight_max, self._gets_in_flight)
            self._stats.gets_in_flight_max = most
        try:
            return await self._answer(request)
        finally:
            with self._lock:
                self._gets_in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        cfg = self._config
        fail, cut, stall, seq = self._admit(request, cfg)
        delay = cfg.latency_s + (self._rng.uniform(0.0, cfg.jitter_s) if cfg.jitter_s else 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        if fail:
            self._count(failures=1)
            content_type, body = _error_body(request, cfg.fail_status, seq)
            return self._sent(
                web.Response(status=cfg.fail_status, text=body, content_type=content_type)
            )
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        if cfg.ignore_range and "Range" in request.headers:
            headers = [(k, v) for k, v in headers if k.lower() not in ("range", "if-range")]
            self._count(ranges_ignored=1)
        if cfg.ignore_if_match and "If-Match" in request.headers:
            headers = [(k, v) for k, v in headers if k.lower() != "if-match"]
            self._count(if_match_ignored=1)
        assert self._session is not None
        try:
            upstream = await self._session.request(
                request.method,
                URL(self.upstream + request.raw_path, encoded=True),  # no re-quoting: SigV4
                headers=headers,
                data=request.content if request.body_exists else None,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            self._count(upstream_errors=1)
            return self._sent(web.Response(status=502, text=f"cloudsim: upstream failed: {exc!r}"))
        async with upstream:
            response = self._sent(
                web.StreamResponse(status=upstream.status, reason=upstream.reason)
            )
            for name, value in upstream.headers.items():
                if cfg.chunked and name.lower() == "content-length":
                    continue
                if name.lower() not in _HOP_BY_HOP:
                    if name.lower() == "location" and value.startswith(self.upstream):
                        value = self.url + value[len(self.upstream) :]  # keep the client here
                    response.headers.add(name, value)
            length = upstream.content_length
            fault_at = (
                cfg.cut_after_bytes if length is None else min(cfg.cut_after_bytes, length - 1)
            )
            pinned = _pinned_cut(cfg, request, upstream)
            if pinned is not None:
                fault_at = pinned
                stall, cut = (True, False) if cfg.stall_at_offset else (stall, True)
            # A fault needs a body to break: only 200/206 answers with at least one byte.
            cut = cut and upstream.status in _CUTTABLE and fault_at >= 0
            stall = stall and upstream.status in _CUTTABLE and fault_at >= 0
            try:
                await response.prepare(request)
                await self._relay(request, response, upstream, cfg, cut, stall, fault_at)
            except ConnectionError:
                self._count(client_disconnects=1)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                self._count(upstream_errors=1)  # pass a broken upstream body on as a broken one
                if request.transport is not None:
                    request.transport.abort()
        return response

    async def _relay(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        cfg: SimConfig,
        cut: bool,
        stall: bool,
        fault_at: int,
    ) -> None:
        """Stream the body, paced and faulted as configured."""
        loop = asyncio.get_running_loop()
        bps, total = cfg.bandwidth_bps, cfg.total_bandwidth_bps
        pace = min(x for x in (bps, total, float("inf")) if x > 0)
        step = max(1024, min(1 << 16, int(pace / 100))) if pace < float("inf") else 1 << 30
        sent, start = 0, loop.time()

        async def send(data: bytes) -> None:
            nonlocal sent
            if bps > 0 and (wait := start + sent / bps - loop.time()) > 0:
                await asyncio.sleep(wait)
            if total > 0:  # every body takes its turn on the shared bottleneck
                now = loop.time()
                self._link_free = max(self._link_free, now) + len(data) / total
                await asyncio.sleep(self._link_free - now)
            self._count(bytes_sent=len(data))  # before the client can see them: stats never lag
            await response.write(data)
            sent += len(data)

        async for chunk in upstream.content.iter_any():
            for piece in (chunk[i : i + step] for i in range(0, len(chunk), step)):
                split = fault_at - sent if cut or stall else -1
                if not 0 <= split < len(piece):
                    await send(piece)
                    continue
                self._count(**{"cuts" if cut else "stalls": 1})
                if split:
                    await send(piece[:split])
                if cut:
                    await self._cut(request, cfg.cut_mode)
                    return
                stall = False
                await asyncio.sleep(cfg.stall_s)
                await send(piece[split:])

    async def _cut(self, request: web.Request, mode: str) -> None:
        """Disconnect after what was written: FIN once flushed ("close") or RST ("reset")."""
        transport = request.transport
        if transport is None:
            return
        if mode == "close":
            transport.close()  # flushes the buffer first, then FIN
            return
        for _ in range(200):  # let the kernel take what was written, then reset
            if transport.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.005)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


def _pinned_cut(
    cfg: SimConfig, request: web.Request, upstream: aiohttp.ClientResponse
) -> int | None:
    """Where in this answer's body ``cut_at_offset`` falls (None: not in it, or off)."""
    if cfg.cut_at_offset < 0 or request.method != "GET" or upstream.status not in _CUTTABLE:
        return None
    if cfg.match and re.search(cfg.match, request.raw_path) is None:
        return None
    first = 0  # a 200 carries the object from its first byte
    if upstream.status == 206:
        found = re.match(r"bytes (\d+)-", upstream.headers.get("Content-Range", ""))
        if found is None:
            return None
        first = int(found.group(1))
    length = upstream.content_length
    inside = first <= cfg.cut_at_offset and (length is None or cfg.cut_at_offset < first + length)
    return cfg.cut_at_offset - first if inside else None


# ------------------------------------------------------------------------ subprocess mode
def _knob_argv(knobs: dict[str, Any]) -> list[str]:
    SimConfig().replace(**knobs)  # validate before starting anything
    argv: list[str] = []
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


class CloudSimProcess:
    """``cloudsim.py`` in a subprocess, with the same ``url``/``configure``/``stats``/``stop``."""

    def __init__(self, popen: subprocess.Popen[bytes], url: str) -> None:
        self.popen, self.url = popen, url

    @classmethod
    def start(
        cls, upstream: str, *, log_path: Path | None = None, timeout_s: float = 30.0, **knobs: Any
    ) -> CloudSimProcess:
        """Start ``cloudsim.py`` and wait for its URL; it exits when this process does."""
        argv = [sys.executable, str(Path(__file__).resolve()), "--upstream", upstream]
        argv += ["--port", "0", "--stop-on-stdin-eof", *_knob_argv(knobs)]
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(log_path.open("ab")) if log_path else subprocess.DEVNULL
            popen = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )
        sim = cls(popen, "")
        assert popen.stdout is not None
        ready, _, _ = select.select([popen.stdout], [], [], timeout_s)
        sim.url = popen.stdout.readline().decode().strip() if ready else ""
        if not sim.url.startswith("http://"):
            sim.stop()
            raise RuntimeError(f"cloudsim did not print its URL within {timeout_s} s: {argv}")
        return sim

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{CONTROL_PREFIX}/{path}", data, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def configure(self, **knobs: Any) -> SimConfig:
        data = self._call("POST", "config", knobs)
        return SimConfig().replace(**data)

    def stats(self) -> SimStats:
        return SimStats.from_json(self._call("GET", "stats"))

    def reset_stats(self) -> None:
        self._call("POST", "reset", {})

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (then SIGKILL); return the exit status; idempotent."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                pipe.close()
        return self.popen.returncode

    def __enter__(self) -> CloudSimProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--seed", type=int, default=None, help="seed of the jitter")
    parser.add_argument("--stop-on-stdin-eof", action="store_true", help="exit with the parent")
    for f in dataclasses.fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action="store_true", default=None)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=f"default {f.default!r}")
    args = vars(parser.parse_args(argv))
    base = {k: args.pop(k) for k in ("upstream", "host", "port", "seed", "stop_on_stdin_eof")}
    knobs = {k: v for k, v in args.items() if v is not None}
    try:
        SimConfig().replace(**knobs)
    except ValueError as exc:
        parser.error(str(exc))

    async def serve() -> None:
        sim = CloudSim(base["upstream"], host=base["host"], port=base["port"], seed=base["seed"])
        sim.configure(**knobs)
        print(await sim.start_async(), flush=True)
        done, loop = asyncio.Event(), asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, done.set)
        if base["stop_on_stdin_eof"]:

            def on_stdin() -> None:
                if not os.read(0, 1 << 16):
                    loop.remove_reader(0)
                    done.set()

            loop.add_reader(0, on_stdin)
        try:
            await done.wait()
        finally:
            await sim.stop_async()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
