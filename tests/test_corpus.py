"""The hostile corpus (tests/corpus/*.yaml) through the real CLI.

Every case runs `ckplan.cli.main` in-process in a fresh directory holding the case's files, and
must: exit with its code, print exactly one stderr line `error: ...` holding its fragment, no
traceback, nothing on stdout for bad input (exit 2), and leave the directory as it found it. Cases
marked `subprocess: true` run once more as `python -m ckplan` in a real process (arguments passed
as bytes, so that a lone surrogate reaches ckplan as a non-UTF-8 argument would). The case format
is in tests/corpus/README.md; adding a case is one entry in any tests/corpus/*.yaml file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tree_snapshot import snapshot

from ckplan.cli import main

CORPUS = Path(__file__).resolve().parent / "corpus"
CASE_KEYS = {
    "id",
    "argv",
    "files",
    "model",
    "code",
    "error",
    "json",
    "subprocess",
    "env",
    "skip_if_root",
    "platform",
}
# The valid model that `model:` cases start from (keys set to null are removed).
BASE_MODEL = {
    "name": "corpus",
    "layers": 4,
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "vocab": 100,
}


def load_cases() -> list[dict]:
    cases: list[dict] = []
    for manifest in sorted(CORPUS.glob("*.yaml")):
        for case in yaml.safe_load(manifest.read_text(encoding="utf-8")) or []:
            unknown = set(case) - CASE_KEYS
            assert not unknown, f"{manifest.name}: case {case.get('id')}: unknown keys {unknown}"
            cases.append({**case, "manifest": manifest.name})
    return cases


CASES = load_cases()


def test_the_corpus_is_large_and_well_formed():
    ids = [case["id"] for case in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    assert len(CASES) >= 200
    for case in CASES:
        assert "argv" in case or "model" in case or "model.yaml" in case.get("files", {}), case[
            "id"
        ]
        assert case.get("code", 2) == 0 or case.get("error"), f"{case['id']}: needs `error`"


def materialise(case: dict, root: Path) -> list[str]:
    """Create the case's files under `root`; return its argv."""
    files = dict(case.get("files") or {})
    if "model" in case:
        model = {**BASE_MODEL, **case["model"]}
        files["model.yaml"] = yaml.safe_dump({k: v for k, v in model.items() if v is not None})
    for name, spec in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(spec, str):
            path.write_bytes(spec.encode("utf-8", "surrogateescape"))
            continue
        if spec.get("directory"):
            path.mkdir()
        elif "symlink" in spec:
            path.symlink_to(spec["symlink"])
        elif spec.get("fifo"):
            os.mkfifo(path)
        elif "hex" in spec:
            path.write_bytes(bytes.fromhex(spec["hex"]))
        elif "repeat" in spec:
            path.write_bytes(repeated(spec).encode("utf-8"))
        else:
            path.write_bytes(spec.get("text", "").encode(spec.get("encoding", "utf-8")))
        if "mode" in spec:
            path.chmod(spec["mode"])
    argv = case.get("argv", ["estimate", "model.yaml"])
    return [repeated(arg) if isinstance(arg, dict) else str(arg) for arg in argv]


def repeated(spec: dict) -> str:
    """`{head, repeat, times, tail}`: a long text without writing it out in the manifest."""
    return spec.get("head", "") + spec["repeat"] * spec["times"] + spec.get("tail", "")


def skip_reason(case: dict) -> str | None:
    if case.get("skip_if_root") and hasattr(os, "geteuid") and os.geteuid() == 0:
        return "root reads files whatever their mode"
    if case.get("platform") and not sys.platform.startswith(case["platform"]):
        return f"needs {case['platform']}"
    return None


def check_result(case: dict, code: int, out: str, err: str) -> None:
    expected = case.get("code", 2)
    where = f"{case['manifest']}: {case['id']}"
    assert code == expected, f"{where}: exit {code}, expected {expected}; stderr: {err[:300]}"
    assert "Traceback" not in err, f"{where}: traceback"
    if expected == 0:
        return
    lines = err.splitlines()
    assert len(lines) == 1, f"{where}: {len(lines)} stderr lines: {err[:500]}"
    assert lines[0].startswith("error: "), f"{where}: {lines[0]}"
    assert case["error"] in lines[0], f"{where}: {case['error']!r} not in {lines[0]!r}"
    if expected == 2:
        assert out == "", f"{where}: stdout on bad input: {out[:200]}"
    if case.get("json"):
        json.loads(out)


@pytest.fixture(scope="module")
def empty_dir(tmp_path_factory):
    """The working directory of cases without files (a fresh one each costs more than the case)."""
    return tmp_path_factory.mktemp("corpus")


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_case(case, empty_dir, tmp_path_factory, monkeypatch, capsys):
    if reason := skip_reason(case):
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("case") if case.get("files") or "model" in case else empty_dir
    monkeypatch.chdir(root)
    argv = materialise(case, root)
    before = snapshot(root)
    code = main(argv)
    out, err = capsys.readouterr()
    check_result(case, code, out, err)
    assert snapshot(root) == before, f"{case['id']}: the directory changed"


SUBPROCESS_CASES = [case for case in CASES if case.get("subprocess")]


@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=[case["id"] for case in SUBPROCESS_CASES])
def test_case_in_a_real_process(case, tmp_path):
    if reason := skip_reason(case):
        pytest.skip(reason)
    argv = materialise(case, tmp_path)
    before = snapshot(tmp_path)
    env = {**os.environ, **(case.get("env") or {})}
    result = subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"ckplan", *(os.fsencode(arg) for arg in argv)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=60,  # a hang guard, not a speed check
    )
    out = result.stdout.decode("utf-8", "replace")
    err = result.stderr.decode("utf-8", "replace")
    check_result(case, result.returncode, out, err)
    assert snapshot(tmp_path) == before, f"{case['id']}: the directory changed"
