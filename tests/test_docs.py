"""The documentation's relative links: every one names a file that exists and, with an anchor, a heading in it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
from conftest import REPO

pytestmark = pytest.mark.unit

ROOT = Path(REPO)
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "bench").glob("*.md"),
        *(ROOT / "deploy").rglob("*.md"),
    ]
)

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks (a `# comment` in one is no heading, a `[x](y)` no link)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> List[Tuple[int, str]]:
    text = prose(path.read_text())
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # keeps line numbers
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        out.append((text.count("\n", 0, m.start()) + 1, target))
    return out


def test_slug_is_githubs():
    assert slug("Set-up (Python 3.10+ and pip, nothing else)") == "set-up-python-310-and-pip-nothing-else"
    assert slug("Errors, never hangs") == "errors-never-hangs"
    assert slug("`ppserver status`") == "ppserver-status"


def test_the_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/guarantees.md", "docs/protocol.md", "bench/RESULTS.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(doc: Path):
    dead = []
    for line, target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            dead.append(f"{doc.relative_to(ROOT)}:{line}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{doc.relative_to(ROOT)}:{line}: {target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, "\n".join(dead)


@pytest.mark.unit
def test_the_module_map_names_every_module_and_nothing_else():
    """docs/architecture.md's map of the code lists each module of ppserver and ppclient once."""
    with open(os.path.join(REPO, "docs", "architecture.md")) as f:
        doc = f.read()
    listed = re.findall(r"^\| `((?:ppserver|client/ppclient)/[\w/]+\.py)` \|", doc, re.MULTILINE)
    assert len(listed) == len(set(listed)), sorted(p for p in listed if listed.count(p) > 1)
    modules = {
        os.path.relpath(os.path.join(folder, name), REPO)
        for top in ("ppserver", os.path.join("client", "ppclient"))
        for folder, _, files in os.walk(os.path.join(REPO, top))
        if "__pycache__" not in folder
        for name in files
        if name.endswith(".py")
    }
    assert sorted(modules - set(listed)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(listed) - modules) == [], "docs/architecture.md names modules that do not exist"
