"""``.. readme-section:: Title`` -- one section of the repository's README.md.

The README keeps a few sections that change with every kernel release (the
measured tables of "Performance").  Rather than copying them into the guide,
this directive reads the section at build time and renders it, so the guide
and the README never disagree.

It converts the subset of Markdown those sections use: paragraphs,
``inline code``, **bold**, *italic*, [links](url), bullet lists, fenced code
blocks, pipe tables and ``###`` sub-headings (rendered as rubrics).
"""
from __future__ import annotations

import os
import re

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

_CODE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


def _inline(text: str) -> str:
    """Markdown inline markup -> reST (code spans protected from the rest)."""
    pieces = []  # (is_code, text)
    pos = 0
    for m in _CODE.finditer(text):
        pieces.append((False, _LINK.sub(r"`\1 <\2>`__", text[pos:m.start()])))
        pieces.append((True, m.group(1)))
        pos = m.end()
    pieces.append((False, _LINK.sub(r"`\1 <\2>`__", text[pos:])))
    out = []
    for j, (code, t) in enumerate(pieces):
        if not code:
            out.append(t)
            continue
        lit = f"``{t}``" if t.strip() == t else f":literal:`{t}`"
        # reST inline markup must be delimited by space or punctuation
        before = pieces[j - 1][1][-1:] if j else ""
        after = pieces[j + 1][1][:1] if j + 1 < len(pieces) else ""
        if before and (before.isalnum() or before in "_"):
            lit = "\\ " + lit
        if after and (after.isalnum() or after in "_"):
            lit = lit + "\\ "
        out.append(lit)
    return "".join(out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def markdown_to_rst(md: str) -> list[str]:
    """reST lines for a Markdown fragment (the subset described above)."""
    lines = md.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip() or "text"
            out += [f".. code-block:: {lang}", ""]
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                out.append("   " + lines[i])
                i += 1
            out.append("")
            i += 1
            continue
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$",
                                                                   lines[i + 1].strip()):
            header = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out += [".. list-table::", "   :header-rows: 1", ""]
            for row in [header] + rows:
                row = (row + [""] * len(header))[:len(header)]
                out.append(f"   * - {_inline(row[0]) or '..'}")
                out += [f"     - {_inline(c)}" if c else "     -" for c in row[1:]]
            out.append("")
            continue
        if line.startswith("#"):
            out += [f".. rubric:: {_inline(line.lstrip('#').strip())}", ""]
            i += 1
            continue
        if re.match(r"^\s*[*-] ", line):
            indent = len(line) - len(line.lstrip())
            out.append(" " * indent + "* " + _inline(line.lstrip()[2:]))
            i += 1
            while i < len(lines) and lines[i].strip() and not re.match(r"^\s*[*-] ", lines[i]) \
                    and not lines[i].startswith(("|", "#", "```")):
                out.append(" " * (indent + 2) + _inline(lines[i].strip()))
                i += 1
            if i < len(lines) and not lines[i].strip():
                out.append("")
            continue
        out.append(_inline(line))
        i += 1
    return out + [""]


def readme_section(path: str, title: str) -> str:
    """The Markdown body of ``## title`` in ``path`` (up to the next ``## ``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    m = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise ValueError(f"{path} has no section '## {title}'")
    return m.group(1)


class ReadmeSection(Directive):
    required_arguments = 1
    final_argument_whitespace = True

    def run(self):
        env = self.state.document.settings.env
        path = os.path.join(env.app.confdir, "..", "README.md")
        env.note_dependency(os.path.abspath(path))
        try:
            body = readme_section(path, self.arguments[0])
        except (OSError, ValueError) as exc:
            return [self.state.document.reporter.warning(str(exc), line=self.lineno)]
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(StringList(markdown_to_rst(body), source=path), 0, node)
        return node.children


def setup(app):
    app.add_directive("readme-section", ReadmeSection)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
