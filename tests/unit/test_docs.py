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


PARENT_PATH = re.compile(r"[^\s'\"`(\[{=]*\.\./[^\s'\"`),\]}]*")
ABSOLUTE_PATH = re.compile(r"(?:^|[\s'\"=(\[{,])((?:/[\w.-]+)+)")
HOME_PATH = re.compile(r"~/[^\s'\"`),\]}]*")
LINK_COMMAND = re.compile(r"\bln -s\w* (\S+) (\S+)")
SYSTEM_PATHS = {"/dev/null"}


def paths_outside_the_clone(file: Path) -> list[str]:
    """Paths ``file`` names that lie outside the clone: ``../`` out of the repository root (the
    working directory of make, the README's commands and the configs' relative paths; a link's
    target counts from the link's folder), absolute paths and home-relative ones."""
    found = []
    for line in file.read_text().splitlines():
        if link := LINK_COMMAND.search(line):
            if not (ROOT / link[2]).parent.joinpath(link[1]).resolve().is_relative_to(ROOT):
                found.append(link[1])
            line = line.replace(link[1], "")
        found += [p for p in PARENT_PATH.findall(line) if not (ROOT / p).resolve().is_relative_to(ROOT)]
        found += [p for p in ABSOLUTE_PATH.findall(line) if p not in SYSTEM_PATHS]
        found += HOME_PATH.findall(line)
    return found


@pytest.mark.parametrize(
    "file",
    [README, ROOT / "Makefile", *sorted((ROOT / "configs").rglob("*.yaml"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_shipped_file_names_a_path_outside_the_clone(file):
    """A user's clone has nothing beside it, and a tool never writes beside the folder it was cloned
    into: data goes under the clone (data/gsm8k/) or where the user says (GSM8K_DIR, --set)."""
    assert paths_outside_the_clone(file) == []


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("  path: ../shared/data/gsm8k/train.jsonl", ["../shared/data/gsm8k/train.jsonl"]),
        ("GSM8K ?= ../shared/data/gsm8k/train.jsonl", ["../shared/data/gsm8k/train.jsonl"]),
        ("--output /work/shared/data/train.jsonl", ["/work/shared/data/train.jsonl"]),
        ("cp ~/gsm8k/train.jsonl data/", ["~/gsm8k/train.jsonl"]),
        ("\tln -sfn ../../../flows src/posttrain/flows", ["../../../flows"]),
        ("\tln -sfn ../../flows src/posttrain/flows", []),
        ("  path: data/gsm8k/test.jsonl  # ./data/../data is fine", []),
        ("open http://127.0.0.1:5000 or sqlite:///mlflow.db > /dev/null", []),
    ],
)
def test_paths_outside_the_clone_are_found(tmp_path, line, found):
    file = tmp_path / "f"
    file.write_text(line + "\n")
    assert paths_outside_the_clone(file) == found
