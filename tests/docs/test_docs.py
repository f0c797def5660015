"""Docs that cannot rot: every relative link and every file a doc names exists, every doc says
who it is for, the README stays short, and every command block a doc marks as runnable runs.

A doc marks a fenced block as runnable with an HTML comment on the line before it:
`<!-- doc-test: run -->` runs the block's lines as they are, with the project's venv first on PATH;
`<!-- doc-test: run-instead: COMMAND -->` runs COMMAND, a fast variant of the documented command
(fewer steps, devices or repeats); `<!-- doc-test: save NAME -->` saves the block as NAME for the
doc's runnable blocks. Commands run in the repository root, or, in a doc that saves files, in a
fresh folder holding them (`$DOC_ROOT` is the repository root). docs/development.md says so too.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
MARKER = re.compile(r"^<!-- doc-test: (run|run-instead: (?P<cmd>.+?)|save (?P<save>[\w.-]+)) -->$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Backticked text is checked as a repository path when it starts with one of these folders.
TOP_DIRS = tuple(
    p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "build"
)


def _docs() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found += sorted((ROOT / "examples").rglob("README.md")) + sorted((ROOT / "deploy").rglob("README.md"))
    return [p for p in found if ".venv" not in p.parts]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands in them name files that the command writes)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _ignored(paths: list[str]) -> set[str]:
    """The paths git ignores (outputs such as bench/results/latest.md): named, never committed."""
    if not paths:
        return set()
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(paths),
        capture_output=True,
        text=True,
        check=False,
    )
    return set(proc.stdout.split())


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it <= {README_MAX_LINES}"


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_doc_says_who_it_is_for(doc: Path) -> None:
    paragraphs = [p.strip() for p in doc.read_text().split("\n\n") if p.strip()]
    assert paragraphs[0].startswith("# "), f"{doc.name} must start with its title"
    assert paragraphs[1].startswith("For: "), f"{doc.name}: the paragraph after the title must say 'For: ...'"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    missing = []
    for match in LINK.finditer(_prose(doc.read_text())):
        target = (match.group(1) or match.group(2)).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue
        if not (doc.parent / target).resolve().exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(doc: Path) -> None:
    named = set()
    for span in CODE_SPAN.findall(_prose(doc.read_text())):
        token = span.split("::", 1)[0].rstrip(".,:;")
        if " " in token or "<" in token or "{" in token or "/" not in token:
            continue
        if token.split("/", 1)[0] in TOP_DIRS:
            named.add(token)
    ignored = _ignored(sorted(named))
    missing = sorted(p for p in named if p not in ignored and not _exists(p))
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


@dataclass(frozen=True)
class RunnableBlock:
    doc: str
    line: int
    command: str
    files: tuple[tuple[str, str], ...]  # (name, text) saved beside the command first


def _runnable_blocks() -> list[RunnableBlock]:
    blocks = []
    for doc in _docs():
        lines = doc.read_text().split("\n")
        files: list[tuple[str, str]] = []
        commands: list[tuple[int, str]] = []
        for i, line in enumerate(lines):
            match = MARKER.match(line.strip())
            if not match:
                continue
            assert i + 1 < len(lines) and lines[i + 1].startswith("```"), (
                f"{doc}:{i + 1}: a doc-test marker must stand right before a fenced block"
            )
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 2 : end]) + "\n"
            if match.group("save"):
                files.append((match.group("save"), body))
            else:
                commands.append((i + 2, match.group("cmd") or body))
        name = str(doc.relative_to(ROOT))
        blocks += [RunnableBlock(name, line, command, tuple(files)) for line, command in commands]
    return blocks


def test_docs_mark_runnable_blocks() -> None:
    # The mechanism must not go quiet: if every marker vanished, the runnable test would pass on nothing.
    assert len(_runnable_blocks()) >= 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _runnable_blocks(), ids=lambda b: f"{b.doc}:{b.line}")
def test_runnable_block_runs(block: RunnableBlock, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DOC_ROOT"], env["DOC_TEST_TMP"] = str(ROOT), str(tmp_path)
    for name, text in block.files:
        (tmp_path / name).write_text(text)
    script = "set -euo pipefail\n" + block.command.replace(".venv/bin/", "")
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path if block.files else ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{block.doc}:{block.line}: {shlex.quote(block.command)} exited {proc.returncode}\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )
