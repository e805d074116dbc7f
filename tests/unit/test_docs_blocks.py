"""Every Python and shell block of README.md and docs/ is either run here or says why not.

The line before a block's opening fence is a marker: ``<!-- run -->`` (this test runs it) or
``<!-- not run: REASON -->``. A block of output, a diagram or a file's contents is fenced as
``text`` (or another data language: ``yaml``, ``csv``, ``json``) and needs no marker. A Python
block runs in a fresh namespace in a scratch directory; a shell block's commands (``$ `` prompts
and ``.venv/bin/`` prefixes dropped, the other lines of a console block being output) must be
``pace`` commands, run in-process, each ending with status 0. The scratch directory links the
repository's ``recipes`` and ``tests``, so a block may name their files as the docs do.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from pace_strategy.cli import main as pace

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = {"python", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!-- (run|not run: (?P<reason>.+)) -->$")

pytestmark = pytest.mark.timeout(120)


def blocks() -> list[tuple[str, str, str | None, str]]:
    """(where, language, marker, code) of every fenced block; ``marker`` is ``None`` when absent."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = MARKER.match(before.strip())
            where, code = f"{path.relative_to(ROOT)}:{i + 1}", "\n".join(lines[i + 1 : end])
            out.append((where, opening.group(1), marker.group(1) if marker else None, code))
            i = end + 1
    return out


ALL = blocks()
RUN = [(where, language, code) for where, language, marker, code in ALL if marker == "run"]


def test_every_block_says_its_language_and_every_code_block_whether_it_runs():
    unlabelled = [where for where, language, _, _ in ALL if not language]
    assert not unlabelled, f"fence these as text (output, diagrams) or as their language: {unlabelled}"
    unmarked = [where for where, language, marker, _ in ALL if language in CODE and marker is None]
    assert not unmarked, f"say <!-- run --> or <!-- not run: REASON --> before: {unmarked}"
    assert len(RUN) >= 4  # the marker is not a way out of running the docs


def commands(code: str, language: str) -> list[list[str]]:
    """The ``pace`` commands of a shell block, as argument lists."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        if language == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if not words:
                continue
            words[0] = words[0].removeprefix(".venv/bin/")
            assert words[0] == "pace", f"only pace commands are run here: {part!r}"
            out.append(words[1:])
    return out


@pytest.mark.parametrize(("where", "language", "code"), RUN, ids=[where for where, _, _ in RUN])
def test_the_block_runs(where, language, code, tmp_path, monkeypatch):
    for name in ("recipes", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    if language == "python":
        exec(compile(code, where, "exec"), {"__name__": "__docs__"})
        return
    for argv in commands(code, language):
        with contextlib.redirect_stdout(io.StringIO()):
            assert pace(argv) == 0, f"{where}: pace {shlex.join(argv)}"
