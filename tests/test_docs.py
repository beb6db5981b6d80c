"""README.md and docs/: every shown command prints what is shown; links resolve; the documents
speak of the project and its sources alone."""

from __future__ import annotations

import re

import pytest
from doc_examples import (
    DOCUMENTS,
    ROOT,
    examples,
    matches,
    run,
    scratch_folder,
)

EXAMPLES = [example for document in DOCUMENTS for example in examples(document)]


@pytest.fixture(scope="module")
def folders():
    """One scratch folder per document, shared by its examples in order."""
    opened = {}
    yield lambda document: opened.setdefault(document, scratch_folder()).name
    for folder in opened.values():
        folder.cleanup()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.name)
def test_example_prints_what_it_shows(example, folders):
    if extra := example.missing_extra():
        pytest.skip(f"needs the optional {extra}")
    actual = run(example, folders(example.document))
    assert matches(example.shown, actual), "\n" + "\n".join(actual)


def test_every_document_has_examples_where_it_shows_commands():
    assert len(EXAMPLES) >= 20
    assert any(example.document.name == "README.md" for example in EXAMPLES)


def test_readme_fits_a_screen_or_two():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_checker_reads_its_marks():
    assert matches(["a", "...", "c"], ["a", "b", "b2", "c"])
    assert not matches(["a", "...", "c"], ["a", "b", "c", "d"])
    assert matches(["...", "c", "..."], ["a", "c", "d"])
    assert matches(["step {…} s"], ["step 1.25 s"])
    assert not matches(["a", "b"], ["a", "b", "c"])
    assert not matches(["a"], ["b"])


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_relative_links_resolve(document):
    text = document.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (document.parent / target).exists(), f"{document.name}: broken link {target}"


# Words about how the project was made, or paths a user of the project does not have.
FOREIGN = re.compile(
    r"\bseed design\b|\bthe seed\b|\bseed's\b|shared/|DESIGN\.md|\bhelpers?\b|\bthis task\b"
    r"|\bissue \d+|\bthe issue\b|\bissue's\b|\bsearch tool\b|\bsubagent|\bsession\b"
    r"|\bagent\b|\bin this work\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_documents_speak_of_the_project_alone(document):
    found = [
        f"{document.name}:{number}: {line.strip()}"
        for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1)
        if FOREIGN.search(line)
    ]
    assert not found, "\n".join(found)


def test_every_model_key_is_documented():
    """A key a model file accepts is named in docs/models.md or docs/architectures.md."""
    from ckplan.model.spec import KEY_ORDER

    text = "".join((ROOT / "docs" / name).read_text() for name in ("models.md", "architectures.md"))
    missing = [key for key in KEY_ORDER if f"`{key}`" not in text]
    assert not missing, missing
