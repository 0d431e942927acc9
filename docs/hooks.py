"""MkDocs hook (mkdocs.yml ``hooks:``): console sessions copy their commands only.

A console block shows ``$ command`` lines and their output. Material's copy button copies the
text of the nearest element with a ``data-copy`` attribute when there is one; this hook gives
each console block (a highlighted block with Pygments prompt spans, ``class="gp"``) a
``data-copy`` holding its commands, without the prompts and without the output, so that a
pasted block runs. A command continued with a trailing backslash keeps its next lines.
"""

from __future__ import annotations

import html
import re
from typing import Any

_BLOCK = re.compile(
    r'<div class="(?P<classes>[^"]*\bhighlight\b[^"]*)"><pre>(?P<body>.*?)</pre></div>', re.DOTALL
)
_PROMPT = '<span class="gp">'
_TAG = re.compile(r"<[^>]+>")


def console_commands(body: str) -> list[str] | None:
    """The commands of a highlighted block's HTML, or None if it is no console session."""
    if _PROMPT not in body:
        return None
    commands: list[str] = []
    continued = False
    for line in body.split("\n"):
        start = line.find(_PROMPT)
        if start >= 0 or continued:
            if start >= 0:
                prompt_end = line.index("</span>", start) + len("</span>")
                line = line[prompt_end:]
            text = html.unescape(_TAG.sub("", line))
            commands.append(text)
            continued = text.endswith("\\")
    return commands


def add_copy_text(page_html: str) -> str:
    """``page_html`` with a ``data-copy`` attribute on every console block."""

    def annotate(match: re.Match[str]) -> str:
        commands = console_commands(match.group("body"))
        if commands is None:
            return match.group(0)
        copy = html.escape("\n".join(commands), quote=True)
        return match.group(0).replace(
            f'<div class="{match.group("classes")}">',
            f'<div class="{match.group("classes")}" data-copy="{copy}">',
            1,
        )

    return _BLOCK.sub(annotate, page_html)


def on_page_content(html_text: str, **kwargs: Any) -> str:
    return add_copy_text(html_text)
