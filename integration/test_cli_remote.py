"""The ``cloudshards`` command as a subprocess against real servers: each subcommand's output and
exit code on the dataset nginx serves, ``write`` to moto S3, and one-line errors for bad URLs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import cloudshards

if TYPE_CHECKING:
    from conftest import RemoteDataset
    from servers import S3Server

TIMEOUT_S = 120


def cloudshards_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudshards.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_ls_counts_samples_over_http(http_dataset: RemoteDataset) -> None:
    result = cloudshards_cli("ls", http_dataset.url, "--count")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    local = http_dataset.local
    assert len(lines) == len(local.shards) + 1
    for line, name, keys in zip(lines, local.shards, local.shard_keys, strict=False):
        size = (local.root / name).stat().st_size
        assert line.split("\t") == [
            http_dataset.url_for(name),
            f"{size} bytes",
            f"{len(keys)} samples",
        ]
    total = sum((local.root / name).stat().st_size for name in local.shards)
    assert lines[-1] == f"{len(local.shards)} shards, {total} bytes, {len(local.samples)} samples"


def test_cat_and_head_show_samples_over_http(http_dataset: RemoteDataset) -> None:
    local = http_dataset.local
    head = cloudshards_cli("head", http_dataset.url)
    assert head.returncode == 0, head.stderr
    keys = [line.split()[0] for line in head.stdout.splitlines() if not line.startswith(" ")]
    assert keys == local.shard_keys[0][:3]
    first = local.shard_keys[0][0]
    lines = head.stdout.splitlines()
    assert lines[0] == f"{first}  ({http_dataset.url_for(local.shards[0])})"
    fields = {line.split()[0]: line for line in lines[1:4]}
    sample = local.samples[first]
    assert fields["bin"].split()[1:3] == [f"{len(sample['bin']):,}", "B"]
    assert fields["bin"].split("B  ", 1)[1].startswith(f"<{len(sample['bin']):,} bytes binary: ")
    assert fields["cls"].endswith(f"  {int(sample['cls'])}")
    assert fields["json"].endswith("  " + json.dumps(json.loads(sample["json"])))

    cat = cloudshards_cli("cat", http_dataset.url_for(local.shards[3]), "--fields", "cls")
    assert cat.returncode == 0, cat.stderr
    keys = [line.split()[0] for line in cat.stdout.splitlines() if not line.startswith(" ")]
    assert keys == local.shard_keys[3]  # every sample of the shard
    assert {line.split()[0] for line in cat.stdout.splitlines() if line.startswith(" ")} == {"cls"}


def test_bench_reports_rates_and_io_wait_over_http(
    http_dataset: RemoteDataset, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    result = cloudshards_cli("bench", http_dataset.url, "--cache-dir", str(cache_dir))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{len(http_dataset.local.samples)} samples, ")
    assert "samples/s" in lines[0]
    assert "MB/s" in lines[0]
    assert lines[1].startswith("waiting for I/O ")
    assert re.fullmatch(r"\d+ requests, 0 retries, [\d.]+ MB from the store", lines[2])
    assert lines[3].startswith("cache: 0 hits, 6 downloads")

    info = cloudshards_cli("cache", "info", str(cache_dir))
    assert info.returncode == 0, info.stderr
    assert info.stdout.splitlines()[1].startswith("entries:   6 ")
    cleared = cloudshards_cli("cache", "clear", str(cache_dir))
    assert cleared.returncode == 0
    assert cleared.stdout.startswith("removed 6 entries")


def test_index_over_http(http_dataset: RemoteDataset, tmp_path: Path) -> None:
    output = tmp_path / "train.index.json"
    result = cloudshards_cli("index", http_dataset.url, "--output", str(output))
    assert result.returncode == 0, result.stderr
    count = len(http_dataset.local.samples)
    assert result.stdout.strip() == f"{output}: 6 shards, {count} samples"
    assert output.is_file()


def test_write_a_folder_to_s3_then_list_it(
    s3_server: S3Server, tmp_path: Path, http_dataset: RemoteDataset
) -> None:
    source = tmp_path / "folder"
    for index in range(5):
        (source / "part").mkdir(parents=True, exist_ok=True)
        (source / "part" / f"{index:03d}.txt").write_text(f"text {index}")
        (source / "part" / f"{index:03d}.cls").write_text(str(index))
    fs = s3_server.filesystem()
    fs.mkdir("cli-write")
    env = s3_server.env()
    written = cloudshards_cli(
        "write", str(source), "s3://cli-write/w-%04d.tar", "--maxcount", "2", env=env
    )
    assert written.returncode == 0, written.stderr
    lines = written.stdout.splitlines()
    assert [line.split("\t")[:2] for line in lines[:3]] == [
        ["s3://cli-write/w-0000.tar", "2 samples"],
        ["s3://cli-write/w-0001.tar", "2 samples"],
        ["s3://cli-write/w-0002.tar", "1 samples"],
    ]
    assert lines[3] == "5 samples in 3 shards"
    listed = cloudshards_cli("ls", "s3://cli-write/w-*.tar", "--count", env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1].endswith(", 5 samples")
    samples = list(
        cloudshards.WebDataset(
            "s3://cli-write/w-{0000..0002}.tar",
            shardshuffle=False,
            storage_options={"s3": s3_server.storage_options()},
        ).decode()
    )
    assert [(s["__key__"], s["txt"], s["cls"]) for s in samples] == [
        (f"part/{i:03d}", f"text {i}", i) for i in range(5)
    ]
    with tarfile.open(fileobj=fs.open("cli-write/w-0000.tar", "rb")) as tar:
        assert tar.getnames() == ["part/000.cls", "part/000.txt", "part/001.cls", "part/001.txt"]
    # Writing into a bucket that does not exist: one line, exit 1, nothing published.
    failed = cloudshards_cli("write", str(source), "s3://no-such-bucket/w-%d.tar", env=env)
    assert failed.returncode == 1
    assert failed.stderr.splitlines() == [failed.stderr.strip()]
    assert failed.stderr.startswith("cloudshards: error: ")
    assert "s3://no-such-bucket/w-0.tar" in failed.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ("ls", "{base}/missing-{{000..001}}.tar"),
            1,
            "object not found (shard {base}/missing-000.tar)",
        ),
        (("cat", "{base}/missing.tar"), 1, "object not found (shard {base}/missing.tar)"),
        (("bench", "{base}/missing.tar"), 1, "{base}/missing.tar"),
        (("cat", "http://127.0.0.1:9/refused.tar"), 1, "http://127.0.0.1:9/refused.tar"),
        (("cat", "nope://bucket/x.tar"), 2, "unknown protocol 'nope'"),
        (("cat", "{base}/truncated-000002.tar"), 1, "truncated-000002.tar"),
        (("ls", "{base}/none-*.tar"), 2, "matched no shards"),
    ],
)
def test_wrong_urls_give_one_line_and_nonzero_exit(
    http_dataset: RemoteDataset, args: tuple[str, ...], code: int, message: str
) -> None:
    base = http_dataset.base_url
    result = cloudshards_cli(*(arg.format(base=base) for arg in args))
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cloudshards: error: ")
    assert message.format(base=base) in lines[0]
    assert "Traceback" not in result.stderr
