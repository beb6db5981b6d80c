"""The examples in README.md and docs/*.md, run and compared with what they show.

A ```console block holds commands, each a line starting with `$ ckplan` (continued by a trailing
backslash), and under each the output it prints: stdout, then stderr. The comparison ignores
trailing spaces and trailing blank lines, and reads two marks in the shown output:

- a line `...` stands for any number of lines (a long table cut short);
- `{…}` inside a line stands for any text (a wall-clock time).

Commands run as a user would type them (`shlex`, `#` comments, leading `NAME=value` environment
settings) with `COLUMNS=100` unless the command sets its own, in a scratch folder per document
that holds the repository's presets/, profiles/, examples/, validation/ and tests/, so files
written by one command (`--out`) are read by the next and nothing lands in the checkout. A
command that needs an optional extra that is not installed (torch for `calibrate`) is skipped.

    python tests/doc_examples.py            # check every document; exit 1 on a difference
    python tests/doc_examples.py --update   # rewrite shown outputs that have no marks, and
                                            # re-space marked ones whose words still match
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHARED_FOLDERS = ("presets", "profiles", "examples", "validation", "tests")
DEFAULT_COLUMNS = "100"
SKIP_LINES = "..."
ANY_TEXT = "{…}"
# The extras a subcommand needs to run at all, by module name.
NEEDS = {"calibrate": "torch"}


@dataclass
class Example:
    document: Path
    line: int  # 1-based line of the `$` in the document
    command: str  # as shown, continuation lines joined
    shown: list[str]  # the output lines as shown
    first_output_index: int  # 0-based index of the first output line in the document
    environment: dict[str, str]
    argv: list[str]
    # the extras of this command and of the commands before it in its block (a file the first
    # writes, the next reads): without one of them, the rest of the block is skipped too
    needs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"

    @property
    def marked(self) -> bool:
        return any(line == SKIP_LINES or ANY_TEXT in line for line in self.shown)

    def missing_extra(self) -> str | None:
        return next((m for m in self.needs if importlib.util.find_spec(m) is None), None)


def examples(document: Path) -> list[Example]:
    """Every command of every console block of one document, in order."""
    lines = document.read_text(encoding="utf-8").split("\n")
    found: list[Example] = []
    in_console = False
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            in_console = not in_console and line.strip() == "```console"
            needs: tuple[str, ...] = ()
            index += 1
            continue
        if not (in_console and line.startswith("$ ")):
            index += 1
            continue
        start = index
        command = line[2:]
        while command.endswith("\\"):
            index += 1
            command = command[:-1] + " " + lines[index].strip()
        index += 1
        output_start = index
        while index < len(lines) and not lines[index].startswith(("$ ", "```")):
            index += 1
        environment, argv = _split(command, document, start + 1)
        shown = lines[output_start:index]
        if (extra := NEEDS.get(argv[0] if argv else "")) and extra not in needs:
            needs = (*needs, extra)
        found.append(
            Example(document, start + 1, command, shown, output_start, environment, argv, needs)
        )
    return found


def _split(command: str, document: Path, line: int) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command, comments=True)
    environment = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        environment[name] = value
    if not words or words[0] != "ckplan":
        raise ValueError(f"{document.name}:{line}: a console example must run ckplan: {command}")
    return environment, words[1:]


def scratch_folder() -> tempfile.TemporaryDirectory:
    folder = tempfile.TemporaryDirectory(prefix="ckplan-docs-")
    for name in SHARED_FOLDERS:
        os.symlink(ROOT / name, Path(folder.name) / name)
    return folder


def run(example: Example, folder: str) -> list[str]:
    environment = {**os.environ, "COLUMNS": DEFAULT_COLUMNS, **example.environment}
    environment.pop("FORCE_COLOR", None)
    environment["NO_COLOR"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "ckplan", *example.argv],
        cwd=folder, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode == 3 or "Traceback" in done.stderr:
        raise AssertionError(f"{example.name}: ckplan failed:\n{done.stderr}")
    return _trim((done.stdout + done.stderr).split("\n"))


def _trim(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_matches(shown: str, actual: str) -> bool:
    if ANY_TEXT not in shown:
        return shown == actual
    pattern = ".*".join(re.escape(part) for part in shown.split(ANY_TEXT))
    return re.fullmatch(pattern, actual) is not None


def matches(shown: list[str], actual: list[str]) -> bool:
    """Does the actual output read as shown, with `...` lines skipping any run of lines?"""
    shown = _trim(shown)
    chunks: list[list[str]] = [[]]
    for line in shown:
        if line == SKIP_LINES:
            chunks.append([])
        else:
            chunks[-1].append(line)
    anchored_start = not shown or shown[0] != SKIP_LINES
    anchored_end = not shown or shown[-1] != SKIP_LINES
    position = 0
    for number, chunk in enumerate(chunks):
        if not chunk:
            continue
        last = number == len(chunks) - 1
        starts = [position] if number == 0 and anchored_start else range(position, len(actual))
        for start in starts:
            window = actual[start : start + len(chunk)]
            if len(window) == len(chunk) and all(map(_line_matches, chunk, window)):
                if last and anchored_end and start + len(chunk) != len(actual):
                    continue
                position = start + len(chunk)
                break
        else:
            return False
    if anchored_end and chunks[-1] == [] and len(chunks) == 1:
        return not actual
    return True


def _words(line: str) -> str:
    return " ".join(line.replace("│", " ").replace("┃", " ").split())


def respaced(shown: list[str], actual: list[str]) -> list[str]:
    """`shown` with each line whose words equal a printed line's (in order) replaced by that
    printed line: a table whose columns moved, its content unchanged."""
    out, position = [], 0
    for line in shown:
        if line == SKIP_LINES or ANY_TEXT in line:
            out.append(line)
            continue
        for index in range(position, len(actual)):
            if _words(actual[index]) == _words(line):
                out.append(actual[index])
                position = index + 1
                break
        else:
            out.append(line)
    return out


def refreshed(shown: list[str], actual: list[str], cutoff: float = 0.7) -> list[str]:
    """`shown` with each line replaced by the most similar printed line after the previous one
    (difflib ratio >= `cutoff`): the same rows with new numbers. `...` lines stay."""
    out, position = [], 0
    for line in shown:
        if line == SKIP_LINES or ANY_TEXT in line:
            out.append(line)
            continue
        scores = [
            (difflib.SequenceMatcher(None, _words(line), _words(actual[index])).ratio(), index)
            for index in range(position, len(actual))
        ]
        best = max(scores, default=(0.0, -1))
        if best[0] >= cutoff:
            out.append(actual[best[1]])
            position = best[1] + 1
        else:
            out.append(line)
    return out


def difference(example: Example, actual: list[str]) -> str:
    diff = difflib.unified_diff(_trim(example.shown), actual, "shown", "printed", lineterm="", n=2)
    return f"{example.name}: $ {example.command}\n" + "\n".join(diff)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite unmarked shown outputs")
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="with --update, also replace each line of a marked output by its most similar "
        "printed line (new numbers in the same rows); read the diff before committing",
    )
    parser.add_argument("documents", nargs="*", type=Path, default=DOCUMENTS)
    arguments = parser.parse_args()
    failed = 0
    for document in arguments.documents:
        document = document.resolve()
        found = examples(document)
        if not found:
            continue
        lines = document.read_text(encoding="utf-8").split("\n")
        replacements = []
        with scratch_folder() as folder:
            for example in found:
                if extra := example.missing_extra():
                    print(f"skipped {example.name}: needs {extra}")
                    continue
                actual = run(example, folder)
                if matches(example.shown, actual):
                    continue
                if arguments.update and not example.marked:
                    replacements.append((example, actual))
                    print(f"updated {example.name}")
                elif arguments.update and matches(respaced(example.shown, actual), actual):
                    replacements.append((example, respaced(example.shown, actual)))
                    print(f"re-spaced {example.name}")
                elif arguments.refresh and matches(refreshed(example.shown, actual), actual):
                    replacements.append((example, refreshed(example.shown, actual)))
                    print(f"refreshed {example.name}")
                else:
                    failed += 1
                    print(difference(example, actual))
        for example, actual in reversed(replacements):
            start = example.first_output_index
            lines[start : start + len(example.shown)] = actual
        if replacements:
            document.write_text("\n".join(lines), encoding="utf-8")
    print(f"{failed} example(s) differ" if failed else "every example reads as shown")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
