"""The product stands alone and holds no history: no tracked file names the developers' shared folder beside
the checkout or its data variable, none tells "session N" stories (git holds history), and the README stays a map
(at most 150 lines; no line or table cell over 120 characters outside code blocks, in README and docs/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
MAX_CHARS = 120
# the needles are assembled so that this file does not match them itself (other checkers grep the tree too)
SHARED, DATA_VAR = "../" + "shared", "PDSERVE_" + "DATA_DIR"
FORBIDDEN = [
    ("a 'session N' story", re.compile(r"session[ _-]?[0-9]", re.IGNORECASE)),
    ("the developers' shared folder", re.compile(re.escape(SHARED))),
    ("the shared data variable", re.compile(DATA_VAR)),
]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()


def _tracked_text_files() -> dict[str, str]:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError) as e:  # an export without .git: nothing to list
        pytest.skip(f"not a git checkout ({e})")
    files = {}
    for name in filter(None, names):
        path = ROOT / name
        if name == SELF or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        files[name] = data.decode("utf-8", errors="replace")
    return files


def offending_lines(files: dict[str, str]) -> list[str]:
    """``file:line: what`` for every line of ``files`` that matches a FORBIDDEN pattern."""
    found = []
    for name, text in sorted(files.items()):
        for no, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN:
                if pattern.search(line):
                    found.append(f"{name}:{no}: {what}: {line.strip()[:100]}")
    return found


def long_prose(text: str) -> list[tuple[int, int]]:
    """(line number, length) of Markdown lines or table cells over MAX_CHARS outside fenced code blocks."""
    bad, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        pieces = line.strip().strip("|").split("|") if line.lstrip().startswith("|") else [line]
        longest = max(len(p.strip()) for p in pieces)
        if longest > MAX_CHARS:
            bad.append((no, longest))
    return bad


def test_no_history_and_no_outside_data_in_tracked_files():
    found = offending_lines(_tracked_text_files())
    assert not found, f"{len(found)} line(s) name {SHARED}, {DATA_VAR} or a session:\n" + "\n".join(found)


def test_readme_is_a_map():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                     for p in (ROOT / "docs").rglob("*.md"))])
def test_markdown_lines_are_short(doc):
    bad = long_prose((ROOT / doc).read_text(encoding="utf-8"))
    assert not bad, f"{doc}: lines/cells over {MAX_CHARS} characters: " + ", ".join(f"{doc}:{n} ({c})" for n, c in bad)


def test_the_checks_can_fail():
    files = {"a.py": "x = 1\n# Sess" + "ion 3 raised it\n", "b.md": f"see {SHARED}/DESIGN.md\n{DATA_VAR}=x\n"}
    assert [f.split(": ")[0] for f in offending_lines(files)] == ["a.py:2", "b.md:1", "b.md:2"]
    assert long_prose("ok\n" + "y" * 121 + "\n```\n" + "z" * 200 + "\n```\n| a | " + "c" * 121 + " |\n") == [
        (2, 121), (6, 121)]


def test_test_module_names_are_unique_across_test_folders():
    """tests/unit, tests/integration and tests/e2e are not packages: pytest imports each test file by its
    basename, so two files of one name stop the whole collection ("import file mismatch")."""
    seen: dict[str, Path] = {}
    twins = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if "__pycache__" in path.parts:
            continue
        if path.name in seen:
            twins.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not twins, "rename one of each: " + "; ".join(twins)
