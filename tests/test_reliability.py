"""Reliability: the exit-code contract under crashes, JSON on exit 1, work limits, safe YAML."""

import json
import subprocess
import sys

import pytest
import yaml

from ckplan import cli as ckplan_cli
from ckplan.cli import estimate as estimate_command
from ckplan.inputs import safe_yaml
from ckplan.model import allocator
from ckplan.plan import StrategyError, evaluate, limits, parse_strategy
from ckplan.quoting import integer_digits, one_line, quote
from ckplan.schedules import revolve
from ckplan.schedules.revolve import _best_advance, _revolve_cost


@pytest.mark.parametrize(
    "error", [RuntimeError("boom\nsecond line"), MemoryError(), KeyError(1), ValueError(10**5000)]
)
def test_an_unexpected_exception_exits_3_in_one_line(cli, monkeypatch, error):
    def explode(*args, **kwargs):
        raise error

    monkeypatch.setattr(estimate_command, "evaluate", explode)
    code, out, err = cli("estimate", "gpt2")
    assert code == ckplan_cli.EXIT_INTERNAL == 3
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err
    assert type(error).__name__ in err and "ckplan bug" in err


def test_estimate_optimal_prints_json_when_nothing_fits(cli):
    code, out, err = cli(
        "estimate", "gpt2", "--strategy", "optimal", "--budget", "4.5GB", "--batch", "32",
        "--seq", "1024", "--json",
    )  # fmt: skip
    data = json.loads(out)
    assert code == 1 and data["fits"] is False and data["memory"] is None
    assert data["strategy"] == "optimal" and data["model"]["micro_batch"] == 32
    allocatable = allocator.allocatable_bytes(data["usable_bytes"])  # what may be allocated
    assert data["activation_budget_bytes"] == allocatable - data["model_state_bytes"]
    assert data["notes"] == [err.strip().removeprefix("error: ")]


def test_schedule_prints_json_when_nothing_fits(cli):
    code, out, _ = cli("schedule", "gpt2", "--budget", "4.5GB", "--batch", "32", "--json")
    data = json.loads(out)
    assert code == 1 and data["fits"] is False and data["steps"] == []
    assert data["stages"][0] == "embedding" and data["stages"][-1] == "output+loss"


def test_revolve_split_by_bisection_is_the_scan(monkeypatch):
    """The bisection (convexity of t(l, s)) picks the same first minimum as the full scan."""

    def scan(length, s):
        best, best_cost = -1, None
        for adv in range(1, length):
            right = _revolve_cost(length - adv, s - 1)
            if right is not None and (
                best_cost is None or adv + right + _revolve_cost(adv, s) < best_cost
            ):
                best, best_cost = adv, adv + right + _revolve_cost(adv, s)
        return best

    for length in range(2, 160):
        for s in range(1, 14):
            assert _best_advance(length, s) == scan(length, s), (length, s)
    for length, s in [(1000, 3), (2345, 7), (5000, 70), (777, 2000)]:
        assert _best_advance(length, s) == scan(length, s)
    assert revolve.revolve_min_forwards(1000, 1) == 1000 * 999 // 2


def test_revolve_beyond_the_step_limit_names_the_slots_that_would_do(spec_of):
    spec = spec_of("gpt2", layers=1500)
    with pytest.raises(
        StrategyError, match=r"1,502 stages runs 1,130,255 steps.* at least 2 slots"
    ):
        evaluate(spec, parse_strategy("revolve:1", spec))
    plan = evaluate(spec, parse_strategy("revolve:2", spec))
    assert len(plan.steps) == limits.revolve_steps(1502, 2) <= limits.MAX_SCHEDULE_STEPS


def test_optimal_dp_on_a_deep_stage_answers(spec_of):
    """The DP groups layers on deep stages (schedules.grouping) instead of being refused."""
    spec = spec_of("gpt2", layers=1000)
    plan = evaluate(spec, parse_strategy("optimal", spec), budget=10**12)
    assert plan is not None and plan.activation_bytes <= 10**12


def test_sweep_skips_revolve_schedules_over_the_limit(spec_of):
    from ckplan.plan.search import candidate_strategies

    names = [s.name for s in candidate_strategies(spec_of("gpt2", layers=1500))]
    revolves = [name for name in names if name.startswith("revolve:")]
    assert "revolve:1" not in names and revolves  # the few-slot ones, over the sweep's budget
    for name in revolves:  # each one kept is within the per-schedule limit too
        assert limits.revolve_steps(1502, int(name.split(":")[1])) <= limits.MAX_SCHEDULE_STEPS


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a: &x 1\nb: *x", "aliases"),
        ("a: !!int abc", "tags"),
        ("a: !!timestamp bogus", "tags"),
        ("a: !!python/object:os.system [ls]", "tags"),
        ("a: " + "[" * 5000, "nested deeper"),
        ("a: 1\na: 2", "duplicate key 'a'"),
        ("<<: {a: 1}", "merge keys"),
        ("a: [" + ",".join(["1"] * 20000) + "]", "more than 10,000"),
        ("a: 1\n---\nb: 2", "expected a single document"),
    ],
)
def test_safe_yaml_refuses_with_a_position(text, problem):
    with pytest.raises(yaml.YAMLError) as info:
        safe_yaml.load(text)
    message = safe_yaml.describe_error(info.value)
    assert problem in message and "line" in message and "\n" not in message


def test_safe_yaml_keeps_long_numbers_and_timestamps_as_text():
    data = safe_yaml.load("a: " + "9" * 5000 + "\nb: 2024-13-45\nc: 12\nd: 0.5")
    assert data == {"a": "9" * 5000, "b": "2024-13-45", "c": 12, "d": 0.5}


def test_quote_is_bounded_for_any_value():
    bomb: list = [1] * 9
    for _ in range(8):
        bomb = [bomb] * 9  # 9^9 elements, as an alias bomb loads
    assert len(quote(bomb)) < 130
    assert quote(10**5000) in (
        "<an integer of about 5,000 digits>",
        "<an integer of about 5,001 digits>",
    )
    assert integer_digits(10**5000) in (5000, 5001) and integer_digits(999) == 3
    assert quote("x" * 10**6).endswith("(1,000,000 characters)")
    assert one_line("a\nb\x1b[31m\ud800") == "a b\\x1b[31m\\ud800"
    assert len(one_line("y" * 10**6)) == 400


@pytest.mark.parametrize("argv", [["presets"], ["estimate", "gpt2", "--json"]])
def test_a_closed_stdout_exits_141_not_1(cli, argv):
    """Rich and Typer answer a broken pipe with exit 1, which CI reads as "does not fit"."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ckplan", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    err = process.stderr.read()
    process.stderr.close()
    assert process.wait(timeout=60) == ckplan_cli.EXIT_BROKEN_PIPE == 141 and err == b""


def test_ctrl_c_exits_130(cli, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(estimate_command, "evaluate", interrupt)
    code, out, _ = cli("estimate", "gpt2")
    assert code == 130 and out == ""
