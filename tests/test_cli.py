"""The cloudshards command line: output and exit codes."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from cloudshards.cli import main


def test_ls_lists_sizes_and_counts(make_shards: Any, capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards([2, 3])
    assert main(["ls", shards.spec(), "--count"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(str(shards.paths[0]))
    assert f"{shards.paths[0].stat().st_size} bytes" in out[0]
    assert out[0].endswith("2 samples")
    assert out[-1] == f"2 shards, {sum(p.stat().st_size for p in shards.paths)} bytes, 5 samples"


def test_head_shows_keys_and_fields(make_shards: Any, capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards([3])
    assert main(["head", shards.spec(), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert shards.keys[0] in out
    assert shards.keys[1] in out
    assert shards.keys[2] not in out
    assert "cls" in out
    assert "json" in out


def test_bench_reports_rates(make_shards: Any, capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards([4])
    assert main(["bench", shards.spec()]) == 0
    assert "4 samples" in capsys.readouterr().out


def test_errors_are_one_line_with_exit_codes(
    make_shards: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", f"{tmp_path}/none-*.tar"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("cloudshards: error: glob")
    assert main(["head", str(tmp_path / "missing.tar")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cloudshards: error: object not found (shard {tmp_path}/missing.tar)"]


def test_module_entry_point_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cloudshards.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.startswith("cloudshards ")
