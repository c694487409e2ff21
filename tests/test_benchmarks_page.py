"""Every command BENCHMARKS.md and its history page tell a reader to run exists here and parses."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from kvpager.cli.bench import BENCHES

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "benchmarks" / "history.md"
PAGES = (PAGE, HISTORY)


def _text() -> str:
    return "\n".join(page.read_text(encoding="utf-8") for page in PAGES)


def _commands() -> list[list[str]]:
    """Both pages' fenced command lines (continuations joined, comments dropped), as argv lists."""
    text = _text()
    commands = []
    for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


COMMANDS = _commands()


def test_the_page_cites_commands() -> None:
    assert len(COMMANDS) >= 8


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:80] for c in COMMANDS])
def test_every_cited_command_names_a_script_or_cli_that_exists_and_parses(argv: list[str]) -> None:
    if argv[0] == "python":
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]} is not in the repository"
        return
    assert argv[:2] == ["kvpager", "bench"], f"unexpected command {argv}"
    assert argv[2] in BENCHES, f"kvpager bench has no {argv[2]!r}"
    module = importlib.import_module(BENCHES[argv[2]][0])
    args = module.build_parser().parse_args(argv[3:])  # an unknown or misspelt flag exits here
    out = getattr(args, "json_out", None)
    assert out is None or out.startswith("benchmarks/"), "results belong under benchmarks/"
    if out is not None:
        assert (ROOT / out).is_file(), f"the page cites {out}, which is not in the repository"


def test_no_path_outside_the_repository_is_cited() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w.])/(tmp|work|home|root)/", text), page.name
        for target in re.findall(r"\]\(([^)#]+)", text):
            if "://" in target:
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert resolved.exists(), f"{page.name} links to {target}, which is not in the repository"
        prose = re.sub(r"\]\([^)]*\)", "]", text)  # link targets were checked above
        assert "../" not in prose, f"{page.name} names a path above the repository"
    for result in (ROOT / "benchmarks").iterdir():
        assert not re.search(r"\"/(tmp|work)/", result.read_text(errors="replace")), result.name


def test_benchmarks_folder_holds_only_results_the_pages_cite() -> None:
    text = _text()
    uncited = [p.name for p in (ROOT / "benchmarks").iterdir() if f"benchmarks/{p.name}" not in text]
    assert not uncited, f"cite these in BENCHMARKS.md or benchmarks/history.md, or remove them: {uncited}"


def test_the_results_page_links_its_history() -> None:
    assert "](benchmarks/history.md)" in PAGE.read_text(encoding="utf-8")
