"""The S3 side of bench_s3.py: an s3rver process, and what the store saw (GETs and bytes).

s3rver 3.7.1 (npm) serves Range requests properly, unlike moto (which reads the whole object
for every ranged GET). Its request log, with colours on, has one line per request:
``info: GET /bench/tar/x.tar 206 7ms 2.86mb`` (sizes humanised to 3 digits, a HEAD's as if its
body had been sent). Behind the cloud simulator the simulator's own counters are exact; direct,
the counts come from that log. Only the standard library here: the child imports it too.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

BUCKET = "bench"
KEY = SECRET = "S3RVER"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REQUEST = re.compile(r"info: (GET|HEAD|PUT|POST|DELETE) (\S+) (\d{3}) \S+ (\S+)$")
_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}
_SIZE = re.compile(r"([0-9.]+)([a-z]+)")


def s3_env(endpoint: str) -> dict[str, str]:
    """What every client reads: boto3/s3fs/obstore/aws CLI, and MosaicML's own variable."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class S3rver:
    """``s3rver -d DIR -a 127.0.0.1 -p 0 --configure-bucket bench``, logging to a file."""

    def __init__(self, popen: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.popen, self.url, self.log = popen, url, log

    @classmethod
    def start(cls, binary: Path, workdir: Path, timeout_s: float = 30.0) -> S3rver:
        data, log = workdir / "s3rver-data", workdir / "s3rver.log"
        data.mkdir(parents=True, exist_ok=True)
        argv = [str(binary), "-d", str(data), "-a", "127.0.0.1", "-p", "0"]
        argv += ["--configure-bucket", BUCKET]
        env = {**os.environ, "FORCE_COLOR": "1"}  # without colours the log drops the method
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", _ANSI.sub("", log.read_text()))
            if found:
                return cls(popen, f"http://127.0.0.1:{found.group(1)}", log)
            if popen.poll() is not None:
                break
            select.select([], [], [], 0.05)
        popen.kill()
        raise RuntimeError(f"s3rver did not start: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def _size(text: str) -> int:
    found = _SIZE.fullmatch(text.strip().lower())
    if not found or found.group(2) not in _UNITS:
        return 0
    return round(float(found.group(1)) * _UNITS[found.group(2)])


def parse_log(text: str) -> tuple[int, int]:
    """(GET requests, body bytes of GET answers) in a piece of s3rver's log."""
    gets = nbytes = 0
    for line in _ANSI.sub("", text).splitlines():
        found = _REQUEST.search(line.strip())
        if found and found.group(1) == "GET":
            gets += 1
            nbytes += _size(found.group(4))
    return gets, nbytes


@dataclass
class StoreCounter:
    """Reads the store's counters: ``cloudsim:URL`` (exact) or ``s3rverlog:PATH`` (3 digits)."""

    kind: str
    where: str

    @classmethod
    def from_spec(cls, spec: str) -> StoreCounter:
        kind, _, where = spec.partition(":")
        if kind not in ("cloudsim", "s3rverlog", "none"):
            raise ValueError(f"unknown counter {spec!r}")
        return cls(kind, where)

    def snapshot(self) -> tuple[int, int]:
        """(GETs, bytes) for cloudsim; (log offset, 0) for the s3rver log."""
        if self.kind == "none":  # moto keeps no request log
            return 0, 0
        if self.kind == "cloudsim":
            url = f"{self.where}/__cloudsim__/stats"
            with urllib.request.urlopen(url, timeout=10) as response:
                stats = json.loads(response.read())
            return int(stats["gets"]), int(stats["bytes_sent"])
        time.sleep(0.3)  # s3rver writes a line once the answer has finished
        return Path(self.where).stat().st_size, 0

    def since(self, before: tuple[int, int]) -> tuple[int, int]:
        """GETs and bytes sent since ``before`` (a ``snapshot()``)."""
        if self.kind == "none":
            return 0, 0
        if self.kind == "cloudsim":
            gets, nbytes = self.snapshot()
            return gets - before[0], nbytes - before[1]
        time.sleep(0.3)
        with open(self.where, "rb") as f:
            f.seek(before[0])
            return parse_log(f.read().decode("utf-8", "replace"))


_S = TypeVar("_S", bound="_LocalServer")


class _LocalServer:
    """A server process on a free port of 127.0.0.1, logging to a file."""

    def __init__(self, popen: subprocess.Popen[bytes], url: str) -> None:
        self.popen, self.url = popen, url

    @staticmethod
    def free_port() -> int:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])

    @classmethod
    def launch(
        cls: type[_S],
        name: str,
        argv: list[str],
        port: int,
        log: Path,
        ready: Callable[[str], object],
        poll_s: float,
        timeout_s: float,
    ) -> _S:
        """Start ``argv`` (``name``) and wait until ``ready(url)`` raises no OSError."""
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        server = cls(popen, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ready(server.url)
                return server
            except OSError:
                if popen.poll() is not None:
                    break
                select.select([], [], [], poll_s)
        server.stop()
        raise RuntimeError(f"{name} did not start: see {log}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)


class Moto(_LocalServer):
    """``moto_server`` (the S3 server the tests use, pip-installable) under the driver's
    interpreter, holding a copy of the benchmark's bucket. moto reads the whole object for
    every GET, ranged ones included: a loader that reads a shard as many ranged GETs pays
    for it here, as a user who compares loaders on moto would see."""

    @classmethod
    def start(cls, workdir: Path, timeout_s: float = 30.0) -> Moto:
        import sys

        port = cls.free_port()
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

        def ready(url: str) -> None:
            urllib.request.urlopen(url + "/moto-api/", timeout=5).close()

        return cls.launch("moto_server", argv, port, workdir / "moto.log", ready, 0.1, timeout_s)

    def mirror(self, source: str) -> None:
        """Copy every object of the benchmark's bucket from the S3 server at ``source``."""
        import boto3  # the driver's interpreter only

        def client(endpoint: str) -> Any:
            return boto3.client(
                "s3",
                endpoint_url=endpoint,
                aws_access_key_id=KEY,
                aws_secret_access_key=SECRET,
                region_name="us-east-1",
            )

        src, dst = client(source), client(self.url)
        dst.create_bucket(Bucket=BUCKET)
        for page in src.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for item in page.get("Contents", []):
                body = src.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
                dst.put_object(Bucket=BUCKET, Key=item["Key"], Body=body)


# ------------------------------------------------------------------------------------- GCS
GCS_PROJECT = "bench"


def gcs_env(endpoint: str) -> dict[str, str]:
    """What gcsfs and google-cloud-storage read to reach the emulator, anonymously."""
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "GOOGLE_CLOUD_PROJECT": GCS_PROJECT,
        # gcsfs otherwise makes a gRPC call per bucket that times out after 60 s (TESTBED.md).
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


class FakeGCS(_LocalServer):
    """fake-gcs-server (in-memory backend) on a free port, with the benchmark's bucket."""

    @classmethod
    def start(cls, binary: Path, workdir: Path, timeout_s: float = 30.0) -> FakeGCS:
        port = cls.free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
        argv += ["-backend", "memory", "-external-url", url, "-log-level", "warn"]
        # XML-API downloads (/bucket/object: obstore's reads) answer only on the public host:
        # this one, on any port (the simulator in front keeps the Host header).
        argv += ["-public-host", "127.0.0.1"]

        def ready(url: str) -> None:  # the bucket made is the answer
            body = json.dumps({"name": BUCKET}).encode()
            path = f"/storage/v1/b?project={GCS_PROJECT}"
            gcs_request(url, "POST", path, body, "application/json")

        log = workdir / "fake-gcs.log"
        return cls.launch("fake-gcs-server", argv, port, log, ready, 0.05, timeout_s)


def gcs_request(endpoint: str, method: str, path: str, body: bytes, content_type: str) -> bytes:
    """One request to the GCS JSON API (the stdlib only: the child imports this module too)."""
    request = urllib.request.Request(
        endpoint + path, data=body, method=method, headers={"Content-Type": content_type}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return bytes(response.read())


def gcs_upload(endpoint: str, name: str, path: Path) -> None:
    """Upload a file as ``gs://BUCKET/name`` (a simple media upload)."""
    from urllib.parse import quote

    query = f"uploadType=media&name={quote(name, safe='')}"
    gcs_request(
        endpoint,
        "POST",
        f"/upload/storage/v1/b/{BUCKET}/o?{query}",
        path.read_bytes(),
        "application/octet-stream",
    )
