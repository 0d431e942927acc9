"""The documentation as a reader meets it, not only as it builds: code that fits the page,
console blocks whose copy button copies commands a shell can run, defaults stated as the code
has them, and a search that finds the words users type.

The site is built once (``mkdocs build --strict``, as ``tox -e docs`` does) and its HTML and
search index are read back. Screenshots in a real browser are ``tox -e docs-check``.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_docs import DOCS, PAGES, parse_blocks

ROOT = DOCS.parent
#: Characters of code that fit a code block at desktop width without scrolling sideways
#: (Material's content column at 1280 px wide: 81 characters were seen to fit).
PAGE_WIDTH = 80


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def built_page(site: Path, page: str) -> str:
    name = page.removesuffix(".md")
    path = site / "index.html" if name == "index" else site / name / "index.html"
    return path.read_text(encoding="utf-8")


# --- code that fits and copies ---------------------------------------------------------------


def test_every_code_line_fits_the_page() -> None:
    too_wide = [
        f"{block.page}:{block.line + number}: {len(line)} characters"
        for page in PAGES
        for block in parse_blocks(page, (DOCS / page).read_text(encoding="utf-8"))
        for number, line in enumerate(block.code.splitlines(), 1)
        if len(line) > PAGE_WIDTH
    ]
    assert too_wide == []


def console_commands(code: str) -> list[str]:
    """The commands of a console block: its ``$ `` lines without the prompt."""
    return [line[2:] for line in code.splitlines() if line.startswith("$ ")]


def test_console_blocks_copy_only_their_commands(site: Path) -> None:
    """Material's copy button copies a block's ``data-copy`` text when it has one
    (docs/hooks.py sets it): the commands, no prompts, no output."""
    blocks = re.compile(
        r'<div class="[^"]*\bhighlight\b[^"]*"(?P<attrs>[^>]*)><pre>(.*?)</pre>', re.S
    )
    checked = 0
    for page in PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        expected = [
            "\n".join(console_commands(b.code))
            for b in parse_blocks(page, text)
            if b.lang == "console"
        ]
        copied = []
        for match in blocks.finditer(built_page(site, page)):
            if 'class="gp"' not in match.group(2):
                continue
            attribute = re.search(r'data-copy="([^"]*)"', match.group("attrs"))
            assert attribute is not None, f"{page}: a console block without data-copy"
            copied.append(html.unescape(attribute.group(1)))
        assert copied == expected, page
        checked += len(copied)
    assert checked >= 5


def test_the_copy_text_of_a_continued_command_keeps_its_lines() -> None:
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    body = (
        '<span></span><code><span class="gp">$ </span>torchrun a \\\n'
        "    b.py\n"
        '<span class="go">ok &amp; done</span>\n'
        '<span class="gp">$ </span>echo &quot;x&quot;\n</code>'
    )
    assert hooks.console_commands(body) == ["torchrun a \\", "    b.py", 'echo "x"']
    assert hooks.console_commands("<code>plain</code>") is None


# --- stated defaults ---------------------------------------------------------------------------


def _default(function: Callable[..., Any], parameter: str) -> Any:
    return inspect.signature(function).parameters[parameter].default


def _fetch_default(name: str) -> Any:
    from cloudshards.source.options import FetchOptions

    return {f.name: f.default for f in dataclasses.fields(FetchOptions)}[name]


def _cli_default(command: str, option: str) -> Any:
    from cloudshards.cli import _parser

    parser = _parser()
    subcommands = next(a for a in parser._actions if a.dest == "command")
    sub = subcommands.choices[command]  # type: ignore[index]
    return next(a.default for a in sub._actions if option in a.option_strings)


def _webdataset(parameter: str) -> Any:
    import cloudshards as wds

    return _default(wds.WebDataset.__init__, parameter)


def _indexed(parameter: str) -> Any:
    import cloudshards as wds

    return _default(wds.IndexedDataset.__init__, parameter)


def _member_limit_gib() -> int:
    from cloudshards.config import DEFAULT_MAX_MEMBER_BYTES

    return DEFAULT_MAX_MEMBER_BYTES >> 30


def _default_seed() -> int:
    from cloudshards.seeding import default_seed

    return default_seed()


def _memory_bound_mib() -> int:
    from cloudshards.source.options import FetchOptions

    return FetchOptions().max_buffered_bytes >> 20


#: (page, a pattern whose group is the default the page states, the default in the code).
STATED_DEFAULTS: list[tuple[str, str, Callable[[], Any]]] = [
    ("performance.md", r"`prefetch=K` \(default (\d+);", lambda: _fetch_default("prefetch")),
    (
        "performance.md",
        r"`part_bytes` \(default (\d+) MiB\)",
        lambda: _fetch_default("part_bytes") >> 20,
    ),
    (
        "performance.md",
        r"`concurrency` of them in flight \(default (\d+)\)",
        lambda: _fetch_default("concurrency"),
    ),
    ("performance.md", r"`retries` times \(default (\d+)\)", lambda: _fetch_default("retries")),
    (
        "performance.md",
        r"`stall_timeout_s` \(default (\d+) s\)",
        lambda: int(_fetch_default("stall_timeout_s")),
    ),
    ("performance.md", r"(\d+) MiB with the defaults", _memory_bound_mib),
    ("storage.md", r"\(`retries=`, default (\d+)\)", lambda: _fetch_default("retries")),
    ("storage.md", r"`wds\.(\w+)` \(default\)", lambda: _webdataset("handler").__name__),
    ("caching.md", r"(-?\d+) \(default\) for no limit", lambda: _webdataset("cache_size")),
    (
        "distributed.md",
        r'balances epochs by default \(`balance="(\w+)"`\)',
        lambda: _webdataset("balance"),
    ),
    ("indexed.md", r"\(`max_workers`, default (\d+)\)", lambda: _indexed("max_workers")),
    (
        "cli.md",
        r"\(`--workers` at a time, default (\d+)\)",
        lambda: _cli_default("index", "--workers"),
    ),
    ("security.md", r"`CLOUDSHARDS_MAX_MEMBER_BYTES`, (\d+) GiB by default", _member_limit_gib),
    ("getting-started.md", r"\(default seed (\d+),", _default_seed),
]


@pytest.mark.parametrize(("page", "pattern", "actual"), STATED_DEFAULTS, ids=lambda v: str(v)[:40])
def test_stated_defaults_are_the_code_defaults(
    page: str, pattern: str, actual: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith(("CLOUDSHARDS_", "WDS_")):
            monkeypatch.delenv(name)
    text = " ".join((DOCS / page).read_text(encoding="utf-8").split())
    found = re.findall(pattern, text)
    assert len(found) == 1, f"{page}: the statement {pattern!r} is gone or ambiguous"
    assert found[0] == str(actual()), f"{page} says {found[0]}, the code {actual()!r}"


# --- search ------------------------------------------------------------------------------------

#: Words users type into the search box, and the fewest sections each must find.
SEARCH_TERMS = {"MinIO": 2, "endpoint_url": 5, "set_epoch": 4, "cache_dir": 5, "SlowDown": 1}


def _tokens(text: str, separator: re.Pattern[str]) -> set[str]:
    """Words as Material's search (lunr) indexes them: split by the configured separator,
    lower-cased (stemming applies alike to both sides, so it is left out)."""
    return {token.lower() for token in separator.split(text) if token}


def test_search_finds_every_section_that_uses_a_term(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    separator = re.compile(index["config"]["separator"])
    sections = [
        (doc["location"], html.unescape(re.sub(r"<[^>]+>", " ", doc["title"] + " " + doc["text"])))
        for doc in index["docs"]
    ]
    for term, fewest in SEARCH_TERMS.items():
        query = _tokens(term, separator)
        using = [(where, text) for where, text in sections if term.lower() in text.lower()]
        missed = [where for where, text in using if not query <= _tokens(text, separator)]
        assert len(using) >= fewest, f"{term!r}: only {len(using)} sections use it"
        assert missed == [], f"a search for {term!r} misses {missed}"


# --- navigation ----------------------------------------------------------------------------------


def test_menu_labels_are_the_page_titles(site: Path) -> None:
    """mkdocs.yml names pages without labels, so the menu shows each page's own title."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:\n") :].split("\n\n", 1)[0].splitlines()[1:]
    entries = [line.strip() for line in nav if line.strip().startswith("- ")]
    assert all(re.fullmatch(r"- [\w-]+\.md", entry) for entry in entries), entries
    assert sorted(entry[2:] for entry in entries) == sorted(PAGES)
    home = built_page(site, "index.md")
    assert "md-footer__link--next" in home  # previous/next links at the bottom


# --- the API reference -----------------------------------------------------------------------


def _text(page_html: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page_html))


def test_api_returns_sections_are_one_value_each(site: Path) -> None:
    """A wrapped description of what a function returns is one row, not a row per line."""
    page = built_page(site, "api.md")
    sections = re.findall(r"Returns:.*?<tbody>(.*?)</tbody>", page, flags=re.S)
    assert len(sections) >= 5
    assert [section.count("<tr") for section in sections] == [1] * len(sections)


def test_api_shows_no_private_signature_and_no_internal_names(site: Path) -> None:
    text = _text(built_page(site, "api.md"))
    assert re.findall(r"\b_[a-z]\w*\(", text) == []  # e.g. _map(data, f) under "map"
    for internal in ("iterator1", "invoke", "decode1", "next_stream", "DecodeError.k"):
        assert f'id="cloudshards.{internal}' not in built_page(site, "api.md")
        assert not re.search(rf"\b{re.escape(internal)}\b", text), internal


def test_api_table_of_contents_lists_objects_not_every_method(site: Path) -> None:
    page = built_page(site, "api.md")
    start = page.index('<nav class="md-nav md-nav--secondary"')
    toc = page[start : page.index('<div class="md-content"', start)]
    entries = set(re.findall(r'<a href="(#[^"]*)" class="md-nav__link">', toc))
    assert 40 <= len(entries) <= 90  # it had 129


# --- repository files ----------------------------------------------------------------------------

#: The contributors' page may name the repository's files without linking each.
CONTRIBUTOR_PAGES = {"architecture.md"}


def test_repository_files_named_on_user_pages_are_links() -> None:
    """A reader of the site has no checkout: an example, benchmark or test named on a page
    links to the file in the repository."""
    named = re.compile(r"(?<!\[)`((?:examples|benchmarks|integration|tests)/[^`]*)`")
    unlinked = []
    for page in sorted(set(PAGES) - CONTRIBUTOR_PAGES):
        inside = False
        for number, line in enumerate((DOCS / page).read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith(("```", "~~~")):
                inside = not inside
            if not inside:
                unlinked += [f"{page}:{number}: {m.group(1)}" for m in named.finditer(line)]
    assert unlinked == []
