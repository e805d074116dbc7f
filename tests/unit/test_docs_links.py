"""Every relative link in README.md, CHANGELOG.md and docs/ points at a file that exists, and every
``#anchor`` at a heading of that file (GitHub's slugs: lower case, punctuation dropped, spaces to
hyphens, a repeated heading numbered)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # not http:, mailto:


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        for target in links(doc):
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_slugs_are_github_s():
    assert slug("Scale (`benchmarks/scale.py`)") == "scale-benchmarksscalepy"
    assert slug("What you get") == "what-you-get"
    assert slug("HSDP: the replicate all-reduce") == "hsdp-the-replicate-all-reduce"
