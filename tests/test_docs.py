"""Run the documentation's code blocks, so the docs stay true.

The convention for ``docs/*.md``:

- ``python`` blocks run, in page order, in one namespace per page, with a fresh temporary
  directory as the working directory. The namespace starts with the page's variables from
  :data:`PAGE_VARIABLES` (local shards written by the fixture, ``urls``, ``epochs``, ...).
- ``console`` blocks are CLI sessions: each ``$ cloudshards ...`` line runs the CLI in-process
  (the working directory holds the page's files; ``/data`` and ``/local_nvme`` in a command
  stand for its ``data`` and ``local_nvme`` folders). Its output must match the lines under
  it, with every number a wildcard (timings and sizes vary) and runs of spaces equal.
  ``$ echo $?`` prints the last exit code, which must match exactly. A tqdm progress line in
  the docs is skipped (the bar only shows on a terminal).
- A block right after an HTML comment ``<!-- no-run: REASON -->`` is shown, not run (it needs
  S3, GCS, torchrun, a GPU, ...). The reason is required.
- Other languages (``bash``, ``json``, ``text``) are shown only.
- A page with ``python`` or ``console`` blocks must run at least one of them, unless it is in
  :data:`NOTHING_TO_RUN` with a reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import warnings
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
RUNNABLE = {"python", "console"}
NO_RUN = re.compile(r"^\s*<!--\s*no-run\b(?P<colon>:?)(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)[^`]*$")
NUMBER = re.compile(r"((?<![A-Za-z])\d[\d,.]*)")  # not the 3 of s3 or the 264 of h264
PROGRESS = re.compile(r"^\S[^:]*: .*\[\d\d:\d\d")
DOC_ROOTS = ("data", "local_nvme")  # /data and /local_nvme in console blocks: folders of the cwd

# Pages whose python/console blocks may all be no-run, and why.
NOTHING_TO_RUN: dict[str, str] = {
    "migrating.md": "its example turns on a process-wide import hook in front of a user program",
    "api.md": "generated from docstrings: it has no code blocks of its own",
    "index.md": "its S3 training loop needs a bucket: integration/test_docs_s3.py runs it",
}


@dataclass
class Block:
    """One fenced code block of a page."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip_reason: str | None  # the no-run reason, or None to run it

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def parse_blocks(page: str, text: str) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the no-run marker that precedes it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    previous = ""  # the last non-blank line outside a block
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            if lines[i].strip():
                previous = lines[i]
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        start, body = i, []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        assert i < len(lines), f"docs/{page}:{start + 1}: code block never closed"
        i += 1
        marker = NO_RUN.match(previous)
        reason = None
        if marker is not None:
            reason = marker["reason"].strip()
            hint = f"docs/{page}:{start + 1}: write the reason: <!-- no-run: REASON -->"
            assert marker["colon"], hint
            assert reason, hint
            assert opening["lang"] in RUNNABLE, (
                f"docs/{page}:{start + 1}: no-run marks a {opening['lang'] or 'plain'} block, "
                "which is never run anyway"
            )
        blocks.append(Block(page, start + 1, opening["lang"], "\n".join(body) + "\n", reason))
        previous = ""
    stray = [n + 1 for n, line in enumerate(lines) if NO_RUN.match(line)]
    marked = {b.line for b in blocks if b.skip_reason is not None}
    assert len(stray) == len(marked), f"docs/{page}: a no-run marker is not right before a block"
    return blocks


# --- the data the pages' blocks use ------------------------------------------------------------


def write_image_shards(directory: Path, *, num_shards: int = 8, per_shard: int = 4) -> str:
    """Small image shards (``jpg``, ``cls``, ``json``) and their index; returns the spec."""
    import cloudshards as wds

    rng = np.random.default_rng(0)
    pattern = str(directory / "train-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for index in range(num_shards * per_shard):
            sink.write(
                {
                    "__key__": f"sample{index:06d}",
                    "jpg": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8),
                    "cls": index % 10,
                    "json": {"index": index},
                }
            )
    spec = f"{directory}/train-{{000000..{num_shards - 1:06d}}}.tar"
    wds.write_index(wds.build_index(spec), str(directory / "train.index.json"))
    return spec


def image_data(root: Path) -> dict[str, Any]:
    import torch

    import cloudshards as wds

    urls = write_image_shards(root / "data")
    saved: list[Any] = []
    return {
        "wds": wds,
        "torch": torch,
        "urls": urls,  # what the pages call "your shard spec"
        "index_url": str(root / "data" / "train.index.json"),
        "epochs": 2,
        "checkpoint": None,  # no checkpoint yet: the resume example starts fresh
        "save": saved.append,  # the user's checkpoint function
    }


def writing_data(root: Path) -> dict[str, Any]:
    import cloudshards as wds

    rng = np.random.default_rng(0)
    source = [(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8), i % 10) for i in range(12)]
    return {"wds": wds, "source": source}


def cli_data(root: Path) -> dict[str, Any]:
    """The files cli.md's sessions show: ``/data`` is ``root/data``, the cwd is ``root``."""
    import cloudshards as wds

    data = root / "data"
    data.mkdir()
    write_media_shards(data)
    for animal in ("cats", "dogs"):
        folder = root / "photos" / animal
        folder.mkdir(parents=True)
        for index in range(60):
            (folder / f"{index:03d}.jpg").write_bytes(jpeg(index, (24, 32)))
            (folder / f"{index:03d}.json").write_text(json.dumps({"animal": animal, "i": index}))
    for target in [str(data / "train-%06d.tar"), "memory://docs-store/train-%06d.tar"]:
        with wds.ShardWriter(target, maxcount=20, verbose=0) as sink:
            for index in range(200):
                sink.write({"__key__": f"{index:06d}", "bin": bytes(2000), "cls": index % 10})
    # A node cache after two epochs over a store's ten shards (memory:// is not local, so it is
    # cached like s3://).
    cache_dir = str(root / "local_nvme" / "cloudshards-cache")
    dataset = wds.WebDataset("memory://docs-store/train-{000000..000009}.tar", cache_dir=cache_dir)
    for _epoch in range(2):
        for _sample in dataset:
            pass
    return {}


def jpeg(index: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    pixels = np.full((*size, 3), (index * 3 % 256, 90, 200), np.uint8)
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def mp4(size: tuple[int, int], frames: int = 6, rate: int = 6) -> bytes:
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        for t in range(frames):
            pixels = np.full((*size, 3), (40 + 30 * t, 90, 200 - 25 * t), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, "rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def wav(rate: int = 16000, seconds: float = 0.25) -> bytes:
    left = (np.sin(np.arange(int(rate * seconds)) * 0.05) * 12000).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(2)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(np.stack([left, -left // 2], axis=1).astype("<i2").tobytes())
    return out.getvalue()


def write_media_shards(data: Path) -> None:
    """``media-000.tar`` (2 samples) and ``media-001.tar`` (1) with every previewed field."""
    import cloudshards as wds

    video, audio = mp4((24, 32)), wav()
    for shard, indices in enumerate([[0, 1], [2]]):
        with wds.TarWriter(str(data / f"media-{shard:03d}.tar")) as sink:
            for index in indices:
                sink.write(
                    {
                        "__key__": f"clip/{index:04d}",
                        "jpg": jpeg(index, (24, 32)),
                        "json": {"index": index, "caption": f"clip {index}"},
                        "cls": index % 3,
                        "npy": np.arange(12, dtype=np.float32).reshape(3, 4),
                        "mp4": video,
                        "wav": audio,
                    }
                )


def video_data(root: Path) -> dict[str, Any]:
    """Two shards of three samples: a 2 s h264 video (``mp4``), 1 s of FLAC and a class."""
    import torch
    from media import encode_audio, encode_video

    import cloudshards as wds

    (root / "data").mkdir()
    for shard in range(2):
        with wds.TarWriter(str(root / "data" / f"video-{shard}.tar")) as sink:
            for index in range(3):
                sink.write(
                    {
                        "__key__": f"{shard}-{index}",
                        "mp4": encode_video("libx264", "mp4", frames=48 + 12 * index),
                        "flac": encode_audio("flac", "flac", seconds=1.0, rate=16000),
                        "cls": index,
                    }
                )
    return {"wds": wds, "torch": torch, "urls": str(root / "data" / "video-{0..1}.tar")}


PAGE_VARIABLES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "caching.md": image_data,
    "performance.md": image_data,
    "distributed.md": image_data,
    "indexed.md": image_data,
    "writing.md": writing_data,
    "cli.md": cli_data,
    "video.md": video_data,
}


# --- running blocks ----------------------------------------------------------------------------


def run_python(block: Block, namespace: dict[str, Any]) -> None:
    # Pad so that tracebacks show the page's own line numbers.
    code = compile("\n" * block.line + block.code, f"docs/{block.page}", "exec")
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        # torch warns when num_workers exceeds this machine's cores; the docs show real values.
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        exec(code, namespace)


def expected_pattern(line: str) -> re.Pattern[str]:
    parts = [
        r"\d[\d,.]*" if index % 2 else re.escape(part)  # split() puts the numbers at odd places
        for index, part in enumerate(NUMBER.split(" ".join(line.split())))
    ]
    return re.compile("".join(parts))


def run_console(block: Block, root: Path) -> None:
    """Run each ``$ command`` of a CLI session; compare its output with the block's."""
    from cloudshards.cli import main

    sessions: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            sessions.append((line[2:], []))
        else:
            assert sessions, f"{block.where}: a console block starts with a '$ ' command"
            sessions[-1][1].append(line)
    last_rc = 0
    for command, expected in sessions:
        for name in DOC_ROOTS:
            command = re.sub(rf"(?<![\w.])/{name}(?=/|\b)", str(root / name), command)
        argv = shlex.split(command)
        if argv == ["echo", "$?"]:
            output = f"{last_rc}\n"
        else:
            assert argv[0] == "cloudshards", f"{block.where}: only cloudshards commands run"
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    last_rc = main(argv[1:])
                except SystemExit as exc:  # argparse
                    last_rc = int(exc.code or 0)
            output = out.getvalue()
        for name in DOC_ROOTS:
            output = output.replace(str(root / name), f"/{name}")
        actual = [" ".join(line.split()) for line in output.splitlines()]
        wanted = [line for line in expected if line.strip() and not PROGRESS.match(line)]
        assert len(actual) == len(wanted), (
            f"{block.where}: `{command}` printed {len(actual)} lines, the docs show "
            f"{len(wanted)}:\n{output}"
        )
        for got, want in zip(actual, wanted, strict=True):
            pattern = re.compile(re.escape(want)) if argv[0] == "echo" else expected_pattern(want)
            assert pattern.fullmatch(got), (
                f"{block.where}: `{command}` printed\n  {got}\nwhere the docs show\n  {want}"
            )


@contextlib.contextmanager
def global_state_kept(page: str) -> Iterator[None]:
    """Fail a page whose blocks change process-wide state (and put it back for other tests)."""
    from fsspec.implementations.memory import MemoryFileSystem

    from cloudshards import decoders, unsafe

    environ, meta_path = dict(os.environ), list(sys.meta_path)
    registry, opted_in = dict(decoders._registry), unsafe._enabled
    memory = set(MemoryFileSystem.store), set(MemoryFileSystem.pseudo_dirs)
    try:
        yield
    finally:
        for path in set(MemoryFileSystem.store) - memory[0]:
            del MemoryFileSystem.store[path]
        MemoryFileSystem.pseudo_dirs[:] = [
            p for p in MemoryFileSystem.pseudo_dirs if p in memory[1]
        ]
        changed = [
            name
            for name, same in [
                ("os.environ", dict(os.environ) == environ),
                ("sys.meta_path", sys.meta_path == meta_path),
                ("the decoder registry", decoders._registry == registry),
                ("the unsafe-decoder switch", unsafe._enabled == opted_in),
            ]
            if not same
        ]
        os.environ.clear()
        os.environ.update(environ)
        sys.meta_path[:] = meta_path
        decoders._registry.clear()
        decoders._registry.update(registry)
        unsafe._enabled = opted_in
    assert not changed, f"docs/{page}: the code blocks changed {', '.join(changed)}"


PAGES = sorted(path.name for path in DOCS.glob("*.md"))


def blocks_to_run(page: str) -> list[Any]:
    blocks = parse_blocks(page, (DOCS / page).read_text(encoding="utf-8"))
    return [b for b in blocks if b.lang in RUNNABLE and b.skip_reason is None]


def test_every_page_runs_code_or_says_why_not() -> None:
    silent = {page for page in PAGES if not blocks_to_run(page)}
    assert silent == set(NOTHING_TO_RUN), (
        "pages that run no code block must be listed in NOTHING_TO_RUN with a reason, and "
        f"only those: {sorted(silent ^ set(NOTHING_TO_RUN))}"
    )


@pytest.mark.parametrize("page", [page for page in PAGES if page not in NOTHING_TO_RUN])
def test_code_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    to_run = blocks_to_run(page)
    monkeypatch.chdir(tmp_path)
    if page == "video.md":
        from cloudshards import mediabackend

        # Loading torchcodec imports torch._inductor, which sets TORCHINDUCTOR_CACHE_DIR in
        # os.environ: torch's doing, once per process, not the page's.
        assert mediabackend.torchcodec_error() is None
    with global_state_kept(page):
        namespace: dict[str, Any] = {"__name__": f"docs_{page[:-3]}"}
        namespace.update(PAGE_VARIABLES.get(page, lambda root: {})(tmp_path))
        for block in to_run:
            if block.lang == "python":
                run_python(block, namespace)
            else:
                run_console(block, tmp_path)


def test_docs_have_pages() -> None:
    assert {"index.md", "storage.md", "api.md"} <= set(PAGES)


# --- the convention itself ---------------------------------------------------------------------


def test_parse_blocks_reads_markers_and_indented_fences() -> None:
    text = "\n".join(
        [
            "```python",
            "x = 1",
            "```",
            "<!-- no-run: needs S3 -->",
            "",
            "```python",
            "read('s3://b/a.tar')",
            "```",
            "- a list item:",
            "",
            "  ```python",
            "  y = 2",
            "  ```",
            "```bash",
            "ls",
            "```",
        ]
    )
    blocks = parse_blocks("t.md", text)
    assert [(b.line, b.lang, b.code, b.skip_reason) for b in blocks] == [
        (1, "python", "x = 1\n", None),
        (6, "python", "read('s3://b/a.tar')\n", "needs S3"),
        (11, "python", "y = 2\n", None),
        (14, "bash", "ls\n", None),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<!-- no-run -->\n```python\nx\n```\n",  # no reason
        "<!-- no-run: -->\n```python\nx\n```\n",  # empty reason
        "<!-- no-run: shown only -->\n```bash\nls\n```\n",  # bash never runs
        "<!-- no-run: stray -->\ntext\n```python\nx\n```\n",  # not right before the block
        "```python\nx\n",  # never closed
    ],
)
def test_parse_blocks_rejects_bad_markers(text: str) -> None:
    with pytest.raises(AssertionError):
        parse_blocks("t.md", text)


def test_console_output_must_match(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write_image_shards(tmp_path / "data", num_shards=2, per_shard=3)
    good = [
        "$ cloudshards ls /data/train-000000.tar --count",
        "/data/train-000000.tar 1 bytes 3 samples",  # numbers are wildcards, words are not
        "1 shards, 1 bytes, 3 samples",
        "$ cloudshards ls /data/missing-*.tar",
        "cloudshards: error: glob /data/missing-*.tar matched no shards",
        "$ echo $?",
        "2",
    ]
    run_console(Block("t.md", 1, "console", "\n".join(good), None), tmp_path)
    for bad in [
        [line.replace("3 samples", "3 items") for line in good],  # a word differs
        [*good[:3], "extra line", *good[3:]],  # a line too many
        [*good[:6], "0"],  # a failure shown as a success
    ]:
        with pytest.raises(AssertionError):
            run_console(Block("t.md", 1, "console", "\n".join(bad), None), tmp_path)


def test_a_failing_block_fails(tmp_path: Path) -> None:
    with pytest.raises(NameError):
        run_python(Block("t.md", 1, "python", "undefined_name\n", None), {})


def test_the_home_page_shows_the_readme_commands_one_per_block() -> None:
    """The demo and the test run, each in a block of its own (one copy click, one command),
    the same on the home page as in the README, and the README's last one is what CI runs."""

    def commands(text: str) -> list[str]:
        blocks = [b.code for b in parse_blocks("-", text) if b.lang == "bash"]
        return [code for code in blocks if "tox" in code]

    readme = commands((DOCS.parent / "README.md").read_text(encoding="utf-8"))
    home = commands((DOCS / "index.md").read_text(encoding="utf-8"))
    assert len(readme) == 2
    assert all(code.count("\n") == 1 for code in readme)
    assert home == readme
    ci = (DOCS.parent / ".ci" / "run").read_text(encoding="utf-8").splitlines()[-1]
    assert ci.strip() == readme[1].strip()
