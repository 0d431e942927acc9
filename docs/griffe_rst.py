"""A griffe extension for the API reference: render the reST bits of cloudshards' docstrings.

The docstrings are Google style, but some name other objects with Sphinx roles
(``:func:`split_by_node```) and open literal blocks with ``::``. mkdocstrings renders Markdown,
where a role shows up as ``:func:`` before the name. This turns ``:role:`~a.b.c``` into
``c`` (``a.b.c`` without the ``~``) as inline code and drops the ``::`` markers, without
touching the library's docstrings. Loaded by mkdocs.yml; excluded from the site itself.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|data|attr|mod|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def convert(text: str) -> str:
    """Markdown for a docstring with Sphinx roles and ``::`` literal-block markers."""
    text = _ROLE.sub(_role, text)
    lines = []
    for line in text.splitlines():
        if line.strip() == "::":
            continue  # the indented block that follows is a Markdown code block already
        lines.append(line[:-1] if line.endswith("::") and not line.endswith(":::") else line)
    return "\n".join(lines)


class RstRoles(griffe.Extension):
    """Convert each object's docstring as it is created."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
