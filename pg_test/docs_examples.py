"""The README and the docs book as test input: their pages in reading order, with mdBook's
{{#include}} expanded, and the fenced blocks of each page.

A block's info string says what the runner does with it:
- `sql`: runs in the page's psql session, in order. A line `-- ERROR <SQLSTATE>` right after a
  statement says that statement fails with that SQLSTATE; every other statement must succeed.
- `sh`: runs in bash (set -euo pipefail) from the repository root, with PGHOST, PGPORT, PGUSER and
  PGDATABASE naming the page's database.
- `text output`, right after a `sql` or `sh` block: that block's output, compared exactly.
- `sql norun: <why>`, `sh norun: <why>`: not run, for the reason given (a postgresql.conf excerpt,
  a restart, another major).
Any other block (ini, json, yaml, python, plain text) is shown, not run.
"""

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "src"
README = ROOT / "README.md"

INCLUDE = re.compile(r"\{\{#include ([^}:\s]+)(?::([^}\s]*))?\}\}")
ANCHOR = re.compile(r"ANCHOR(?:_END)?:\s*(\w+)")
FENCE = re.compile(r"^(`{3,})(.*)$")
ERROR_MARK = re.compile(r"^\s*-- ERROR ([0-9A-Z]{5})\b")


def pages() -> list[Path]:
    """README.md, then the book's pages in SUMMARY.md order."""
    summary = (DOCS / "SUMMARY.md").read_text()
    return [README] + [DOCS / p for p in re.findall(r"\]\(([^)#]+\.md)\)", summary)]


def expand(path: Path, depth: int = 0, keep_anchors: bool = False) -> str:
    """The page as mdBook renders its source: each `{{#include file}}`, `{{#include file:anchor}}` or
    `{{#include file:a:b}}` replaced by the file, its anchored part or its lines a to b, and the
    anchor lines themselves dropped."""
    assert depth < 5, f"{path}: includes nest too deep"

    def included(m: re.Match) -> str:
        target, spec = (path.parent / m[1]).resolve(), m[2]
        if spec and not re.fullmatch(r"[\d:]+", spec):       # an anchor's name
            raw = expand(target, depth + 1, keep_anchors=True).split("\n")
            try:
                start = next(i for i, l in enumerate(raw) if re.search(rf"ANCHOR:\s*{spec}\b", l))
                end = next(i for i, l in enumerate(raw) if re.search(rf"ANCHOR_END:\s*{spec}\b", l))
            except StopIteration:
                raise AssertionError(f"{path}: {target} has no anchor {spec}") from None
            return "\n".join(l for l in raw[start + 1:end] if not ANCHOR.search(l))
        lines = expand(target, depth + 1).split("\n")
        a, colon, b = (spec or ":").partition(":")                # "", "a", "a:", ":b", "a:b"
        start = int(a) - 1 if a else 0
        end = (int(b) if b else len(lines)) if colon else start + 1
        return "\n".join(lines[start:end])

    text = INCLUDE.sub(included, path.read_text())
    return text if keep_anchors else "\n".join(l for l in text.split("\n") if not ANCHOR.search(l))


@dataclass
class Block:
    page: Path
    line: int          # of the opening fence, in the expanded page
    lang: str
    flags: str         # the rest of the info string
    body: str

    @property
    def norun(self) -> str | None:
        m = re.match(r"norun:\s*(.*)", self.flags)
        return m[1].strip() if m else None

    @property
    def is_output(self) -> bool:
        return self.lang == "text" and self.flags.split()[:1] == ["output"]

    def expected_errors(self) -> list[str]:
        return [m[1] for m in map(ERROR_MARK.match, self.body.split("\n")) if m]

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}, the block at line {self.line} (expanded)"


def blocks(page: Path) -> list[Block]:
    out, fence, start, info, body = [], None, 0, "", []
    for i, line in enumerate(expand(page).split("\n"), 1):
        m = FENCE.match(line.strip()) if fence is None else None
        if fence is None and m:
            fence, start, info, body = m[1], i, m[2].strip(), []
        elif fence is not None and line.strip() == fence:
            lang, _, flags = info.partition(" ")
            out.append(Block(page, start, lang, flags.strip(), "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
    assert fence is None, f"{page}: a fence opened at line {start} never closes"
    return out


def outside_fences(text: str) -> list[str]:
    """The lines of `text` that are not in a fenced block, nor a fence."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line.strip())
        if m and (fence is None or line.strip() == fence):
            fence = m[1] if fence is None else None
        elif fence is None:
            out.append(line)
    return out


def headings(text: str) -> list[str]:
    """The title of each Markdown heading outside fenced blocks."""
    return [h[1] for line in outside_fences(text) if (h := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line))]


def anchor(title: str) -> str:
    """The id GitHub and mdBook give a heading: lowercase, markup and punctuation dropped but `-` and
    `_`, spaces as `-`."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)   # a link's text only
    title = re.sub(r"[`*]", "", title).lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" if c == " " else "" for c in title)


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for title in headings(text):
        a = anchor(title)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out
