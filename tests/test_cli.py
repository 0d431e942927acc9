"""The cloudshards command line: output and exit codes."""

from __future__ import annotations

import os
import re
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


# --- cat / head / write / bench / --help ------------------------------------------------------


def run_cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudshards.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kw,
    )


def write_media_shard(path: Any) -> None:
    import io

    import numpy as np
    from PIL import Image

    from cloudshards import TarWriter

    image = io.BytesIO()
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(image, format="JPEG")
    with TarWriter(str(path)) as sink:
        sink.write(
            {
                "__key__": "img/0001",
                "jpg": image.getvalue(),
                "json": {"caption": "a long caption " * 10, "n": 1},
                "cls": 7,
                "npy": np.zeros((2, 5), np.int16),
                "pyd": {"not": "loaded"},
                "bin": bytes(range(40)),
                "txt.gz": "zipped",
            }
        )
        sink.write({"__key__": "img/0002", "jpg": b"not a jpeg", "txt": "second"})


def test_cat_shows_decoded_previews(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "media.tar"
    write_media_shard(path)
    assert main(["cat", str(path), "--width", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"img/0001  ({path})"
    fields = {line.split()[0]: line for line in lines[1:8]}
    assert fields["jpg"].endswith("JPEG 30x20 RGB")
    assert fields["json"].endswith('{"caption": "a long caption...')
    assert fields["cls"].endswith(" 7")
    assert fields["npy"].endswith("array int16 (2, 5)")
    assert fields["pyd"].endswith("pickle (not loaded: unsafe)")
    assert fields["bin"].endswith("<40 bytes binary: 00 01 02 03 04 05 06 07 ...>")
    assert fields["txt.gz"].endswith("gzip of 6 B: 'zipped'")
    assert " 1 B  7" in fields["cls"]  # the size column
    assert len(fields) == 7
    assert lines[8] == f"img/0002  ({path})"
    # A bad field is shown, not fatal.
    assert lines[9].endswith("10 B  <undecodable .jpg: not an image Pillow can read>")
    assert lines[10].split() == ["txt", "6", "B", "'second'"]
    assert main(["cat", str(path), "-n", "1", "--fields", "cls,jpg"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["img/0001", "cls", "jpg"]


#: What a hostile shard can hide in a field: an OSC title change and a screen clear (C0), a CSI
#: in its one-character C1 form, and a right-to-left override that makes "exe.txt" read "txt.exe".
ESCAPES = "\x1b]0;PWNED\x07\x1b[2J \x9b31m \u202etxt.exe \u2066x\u2069 \x7f"
ESCAPED = "\\x1b]0;PWNED\\x07\\x1b[2J \\x9b31m \\u202etxt.exe \\u2066x\\u2069 \\x7f"


def test_cat_sends_no_escape_sequence_from_a_shard_to_the_terminal(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Zip member names inside an .npz and JSON previews are shown escaped: a shard cannot
    retitle, clear or reorder the user's terminal."""
    import io
    import json
    import tarfile
    import zipfile

    import numpy as np

    npy, npz = io.BytesIO(), io.BytesIO()
    np.save(npy, np.zeros(2))
    with zipfile.ZipFile(npz, "w") as archive:
        archive.writestr(f"{ESCAPES}.npy", npy.getvalue())
    fields = {
        "k.npz": npz.getvalue(),
        "json": json.dumps({"caption": ESCAPES}, ensure_ascii=False).encode(),
    }
    shard = tmp_path / "esc.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for field, data in fields.items():
            info = tarfile.TarInfo(f"s1.{field}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert main(["cat", str(shard), "--width", "200"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 3  # the key, then one line per field
    assert not [char for char in out if not char.isprintable() and char != "\n"]
    shown = {line.split()[0]: line for line in lines[1:]}
    assert shown["k.npz"].endswith(f"npz: {ESCAPED}")
    # json.dumps escapes C0 controls itself (\\u001b), but not C1 controls or overrides.
    assert '"\\u001b]0;PWNED\\u0007\\u001b[2J \\x9b31m \\u202etxt.exe' in shown["json"]


def test_ls_and_errors_send_no_escape_sequence_to_the_terminal(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Object names a listing returns and the text of a store's errors are shown escaped, and
    an error stays on one line."""
    import cloudshards.cli

    (tmp_path / f"{ESCAPES}.tar").write_bytes(b"")
    assert main(["ls", f"{tmp_path}/*.tar"]) == 0
    out = capsys.readouterr().out
    assert ESCAPED in out
    assert not [char for char in out if not char.isprintable() and char not in "\t\n"]

    def failing_open(url: str) -> Any:
        raise OSError(f"503 from the store:\n{ESCAPES}")

    monkeypatch.setattr(cloudshards.cli, "open_shard", failing_open)
    assert main(["cat", str(tmp_path / "x.tar")]) == 1
    err = capsys.readouterr().err
    assert err == f"cloudshards: error: 503 from the store:\\n{ESCAPED}\n"


def test_head_defaults_to_three_samples(
    make_shards: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = make_shards([2, 2])
    assert main(["head", shards.spec()]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[0] != " "]
    assert keys == shards.keys[:3]
    assert main(["cat", shards.spec()]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[0] != " "]
    assert keys == shards.keys


def test_write_a_folder_groups_files_by_key(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import cloudshards

    source = tmp_path / "src"
    for name, data in {
        "b/x.jpg": b"jpg-bytes",
        "b/x.json": b'{"k": 1}',
        "b/x.seg.png": b"png-bytes",
        "a.txt": b"top",
        "b/y.txt": b"why",
        "README": b"no field: skipped",
        ".DS_Store": b"hidden: skipped",
        ".git/config.txt": b"hidden dir: skipped",
    }.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    pattern = str(tmp_path / "out" / "part-%03d.tar")
    assert main(["write", str(source), pattern, "--maxcount", "2", "-q"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"{tmp_path}/out/part-000.tar\t2 samples\t{3 + 9 + 8 + 9:,} bytes",
        f"{tmp_path}/out/part-001.tar\t1 samples\t3 bytes",
        "3 samples in 2 shards",
    ]
    assert caplog.messages == ["skipped README: not a KEY.FIELD file name"]
    samples = list(cloudshards.WebDataset(str(tmp_path / "out" / "part-{000..001}.tar")))
    assert [s["__key__"] for s in samples] == ["a", "b/x", "b/y"]
    assert samples[1]["seg.png"] == b"png-bytes"
    assert samples[1]["json"] == b'{"k": 1}'


def test_write_a_jsonl_manifest(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import cloudshards

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "1.jpg").write_bytes(b"jpeg one")
    manifest = tmp_path / "list.jsonl"
    records = [
        {"__key__": "one", "jpg": "images/1.jpg", "cls": 3, "json": {"w": 2}, "txt": "a cat"},
        {"jpg": str(tmp_path / "images" / "1.jpg"), "txt": "no key: the line number"},
    ]
    manifest.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert main(["write", str(manifest), str(tmp_path / "m-%d.tar"), "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 samples in 1 shards"
    samples = list(cloudshards.WebDataset(str(tmp_path / "m-0.tar")).decode())
    assert [s["__key__"] for s in samples] == ["one", "000000002"]
    assert samples[0]["jpg"] == b"jpeg one"
    assert samples[0]["cls"] == 3
    assert samples[0]["json"] == {"w": 2}
    assert samples[1]["txt"] == "no key: the line number"


def test_write_errors_are_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text('{"__key__": "a", "txt": "fine"}\n{"jpg": "missing.jpg"}\n')
    out = str(tmp_path / "out" / "s-%d.tar")
    cases = [
        ([str(manifest), out], "bad.jsonl:2: field 'jpg': "),
        ([str(tmp_path / "nothing"), out], "no such folder or manifest"),
        ([str(manifest), str(tmp_path / "no-pattern.tar")], "needs one %d-style field"),
        ([str(manifest), out, "--storage-option", "novalue"], "KEY=VALUE"),
    ]
    for argv, message in cases:
        assert main(["write", *argv, "-q"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1
        assert err[0].startswith("cloudshards: error: ")
        assert message in err[0]
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    commands = ["", "ls", "cat", "head", "write", "bench", "cache", "cache info", "cache clear"]
    commands.append("index")
    for command in commands:
        with pytest.raises(SystemExit) as exited:
            main([*command.split(), "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: cloudshards {command}".strip()), command
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert "exit codes: 0 success, 1 a shard or data error" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["nope"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from cloudshards.errors import ShardOpenError

    assert main(["cat", str(tmp_path / "missing.tar")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"cloudshards: error: object not found (shard {tmp_path}/missing.tar)"
    ]
    with pytest.raises(ShardOpenError, match="object not found") as info:
        main(["--debug", "cat", str(tmp_path / "missing.tar")])
    assert isinstance(info.value, FileNotFoundError)  # what webdataset code catches


def test_progress_bars_show_on_a_terminal(make_shards: Any) -> None:
    import fcntl
    import struct
    import termios

    shards = make_shards([300, 300])
    master, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    with subprocess.Popen(
        [sys.executable, "-m", "cloudshards.cli", "bench", shards.spec()],
        stdout=subprocess.PIPE,
        stderr=terminal,
        text=True,
    ) as process:
        os.close(terminal)
        stdout, _ = process.communicate(timeout=120)
    screen = bytearray()
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not data:
            break
        screen.extend(data)
    os.close(master)
    assert process.returncode == 0
    assert "reading: 600 samples" in screen.decode()  # tqdm's bar, on the terminal
    assert stdout.startswith("600 samples, ")
    piped = run_cli("bench", shards.spec())
    assert piped.returncode == 0
    assert piped.stderr == ""  # no bar when stderr is not a terminal
    lines = piped.stdout.splitlines()
    assert lines[0].startswith("600 samples, ")
    assert "samples/s" in lines[0]
    assert "MB/s" in lines[0]
    assert lines[1].startswith("waiting for I/O ")
    assert re.fullmatch(r"0 requests, 0 retries, 0\.0 MB from the store", lines[2])  # local


# --- the inspecting commands do not import torch ------------------------------------------------

#: Runs the command line in this interpreter, then reports whether torch was imported.
_RUN_AND_CHECK_TORCH = """
import runpy, sys
sys.argv = ["cloudshards", *sys.argv[1:]]
try:
    runpy.run_module("cloudshards.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("exit", code or 0, "torch", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "command",
    [["--help"], ["ls"], ["ls", "--count"], ["head"], ["cat", "-n", "2"], ["cache", "info"]],
    ids=" ".join,
)
def test_inspecting_commands_do_not_import_torch(
    command: list[str], make_shards: Any, tmp_path: Any
) -> None:
    shards = make_shards([2, 3])
    target = {"--help": [], "cache": [str(tmp_path)]}.get(command[0], [shards.spec()])
    result = subprocess.run(
        [sys.executable, "-c", _RUN_AND_CHECK_TORCH, *command, *target],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "exit 0 torch False"
