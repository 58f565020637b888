"""The docs a user meets first: the README's commands run, every page is linked, links land, the
README stays a guide (short, no dated measurements), `posttrain --help` says what posttrain does."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from posttrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _code(markdown: str) -> str:
    """The text of fenced blocks and inline code spans: where commands are written."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", markdown, re.S)
    rest = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", rest))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def readme_commands() -> list[tuple[str, ...]]:
    """Every ``posttrain <command> [<subcommand>]`` the README's code names, each once."""
    commands = _subparsers(build_parser())
    found: dict[tuple[str, ...], None] = {}
    for first, second in re.findall(
        r"\bposttrain ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", _code(README.read_text())
    ):
        nested = bool(_subparsers(commands[first])) if first in commands else False
        found[(first, second) if nested and second else (first,)] = None  # `data fetch`, not `run configs`
    return list(found)


def test_the_readme_names_the_main_commands():
    named = {c[0] for c in readme_commands()}
    assert {"run", "validate", "config", "data", "compare", "eval", "rewards", "sweep"} <= named


@pytest.mark.parametrize("command", readme_commands(), ids=" ".join)
def test_every_command_the_readme_names_answers_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: posttrain {' '.join(command)}")


def test_help_opens_by_saying_what_posttrain_does(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage block
    assert description.startswith("Post-train small language models for verifiable reasoning")
    assert "only module that prints" not in out  # the module's note to developers stays in the module
    assert "posttrain run configs/smoke.yaml" in out


def test_the_readme_is_a_short_guide_without_dated_measurements():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    without_links = LINK.sub("", text)  # results pages are named by date; linking them is fine
    assert not DATE.findall(without_links), "dated measurements belong in docs/results/ or docs/benchmarks.md"


def test_the_readme_first_config_validates(tmp_path, capsys):
    block = re.search(r"## Your first config\n\n```yaml\n(.*?)```", README.read_text(), re.S)
    assert block is not None and 25 <= len(block.group(1).splitlines()) <= 45
    path = tmp_path / "first.yaml"
    path.write_text(block.group(1))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _links(README)}
    pages = {p.resolve() for p in DOCS.glob("*.md")} | {(RESULTS / "README.md").resolve()}
    assert not sorted(p.name for p in pages - linked), "add these pages to the README's docs index"


def test_every_results_page_is_linked_from_the_results_index():
    index = RESULTS / "README.md"
    linked = {(RESULTS / t.split("#")[0]).resolve() for t in _links(index)}
    pages = {p.resolve() for p in RESULTS.glob("*.md")} - {index.resolve()}
    assert pages and not sorted(p.name for p in pages - linked), "add these pages to docs/results/README.md"
    assert all(re.fullmatch(r"20\d\d-\d\d-\d\d-[a-z0-9-]+\.md", p.name) for p in pages)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation but '-' and '_' dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize(
    "page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_links_land(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_benchmark_entries_are_dated_newest_first():
    dates = re.findall(r"^## (20\d\d-\d\d-\d\d)", (DOCS / "benchmarks.md").read_text(), re.M)
    assert len(dates) >= 10 and dates == sorted(dates, reverse=True)
