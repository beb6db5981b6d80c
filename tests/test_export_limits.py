"""The plan layer's verdict on which launcher writes a plan (`plan.export_limits.target_reason`)
agrees with what `ckplan.exports.export` accepts, plan by plan and target by target, so that
`search.choose` names a plan for a job's framework by the exports' own rules."""

from __future__ import annotations

import pytest

from ckplan import exports
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.export_limits import (
    FRAMEWORK_TARGETS,
    LAUNCHERS,
    framework_note,
    framework_reason,
    plan_target_reason,
)
from ckplan.plan.search import OFFLOAD_CANDIDATES, candidate_strategies, sweep

# Models and layouts whose plans between them reach every rule `target_reason` mirrors:
# Megatron-LM's uniform and block methods (with virtual stages, a pipeline layout, MTP layers,
# FP8 beside output-discarding modules), torchtitan's releases, the Trainer's and torchtune's
# every layer or none, the torch snippet's per-op and scoped policies (a GPU's sweep offers
# them), offloaded tapes and pipeline stages.
CASES = [
    ("gpt2", {}),
    ("gpt2", {"framework": "hf"}),
    ("gpt2", {"pp": 2, "microbatches": 4}),
    ("llama3-8b", {"dp": 8, "zero": 3, "framework": "hf"}),
    ("llama3-8b", {"dp": 8, "zero": 3, "framework": "torchtitan"}),
    ("llama3-8b", {"dp": 8, "zero": 3, "framework": "torchtitan", "framework_version": "2024.12"}),
    ("llama3-8b", {"dp": 8, "zero": 3, "framework": "deepspeed"}),
    ("llama3-8b", {"pp": 4, "microbatches": 8, "virtual_stages": 2}),
    ("llama3-8b", {"pp": 2, "microbatches": 8, "virtual_stages": 2,
                   "pipeline_layout": "Et*6|t*10|t*10|t*6L"}),
    ("llama3-8b", {"mtp_layers": 1}),
    ("mixtral-8x7b", {"dp": 8, "zero": 1, "ep": 8}),
    ("mixtral-8x7b", {"dp": 8, "zero": 1, "ep": 8, "precision": "fp8"}),
    ("mixtral-8x7b", {"dp": 8, "zero": 1, "ep": 8, "framework": "deepspeed"}),
]  # fmt: skip
# (target, release) pairs: torchtitan's two releases (exports.torchtitan.VERSIONS)
TARGET_RELEASES = [(t, None) for t in LAUNCHERS if t != "torchtitan"] + [
    ("torchtitan", "0.3"),
    ("torchtitan", "0.2"),
]


def _plans(spec):
    """The sweep's plans of `spec` on an H100 at 40 GB (its optimal, policy, mixed and offload
    plans), with every candidate strategy and the offload ones besides."""
    plans = {
        plan.strategy: plan for plan in map(lambda s: evaluate(spec, s), candidate_strategies(spec))
    }
    for name in OFFLOAD_CANDIDATES:
        plans[name] = evaluate(spec, parse_strategy(name, spec))
    for candidate in sweep(spec, 40 * 10**9, gpu=load_gpu("h100-sxm")).candidates:
        plans.setdefault(candidate.plan.strategy, candidate.plan)
    return list(plans.values())


def _accepts(plan, target: str, release: str | None) -> bool:
    """Whether `ckplan export --to TARGET` writes `plan` (no ExportError)."""
    try:
        exports.export(plan, target, version=release)
    except exports.ExportError:
        return False
    return True


@pytest.fixture
def no_offer(monkeypatch):
    """An export's refusal offers the nearest plan, a search over every strategy: not what is
    checked here, and left out for speed."""
    monkeypatch.setattr(exports, "_offer", lambda *args, **kwargs: "")


@pytest.mark.parametrize("model, keys", CASES)
def test_the_plan_layer_says_which_launcher_writes_a_plan_as_the_exports_do(model, keys, no_offer):
    """For every plan and every target that runs the model and layout (it writes the plan
    `none`), `target_reason` is None exactly when `exports.export` writes the plan; where the
    target refuses the layout itself the export writes no plan, which the plan layer, judging
    what differs between plans of a job, does not repeat."""
    spec = load_spec(model, keys)
    plans = _plans(spec)
    stored = evaluate(spec, parse_strategy("none", spec))
    verdicts = {True: 0, False: 0}
    for target, release in TARGET_RELEASES:
        if not _accepts(stored, target, release):
            assert not any(_accepts(plan, target, release) for plan in plans[:5])
            continue
        for plan in plans:
            accepted = _accepts(plan, target, release)
            mine = plan_target_reason(plan, target, release)
            assert accepted == (mine is None), (target, release, plan.strategy, mine)
            verdicts[accepted] += 1
    assert verdicts[True] and verdicts[False], verdicts  # both kinds of plans were judged


@pytest.mark.parametrize("model, keys", CASES)
def test_a_plan_of_the_framework_is_one_a_target_of_the_framework_writes(model, keys, no_offer):
    """`framework_reason` is None exactly when one of the framework's targets writes the plan
    (at the release the job runs), where that target runs the layout; its note names an export
    that writes the plan where one does."""
    spec = load_spec(model, keys)
    targets = FRAMEWORK_TARGETS[spec.framework]
    stored = evaluate(spec, parse_strategy("none", spec))
    running = [t for t in targets if _accepts(stored, t, None)]
    for plan in _plans(spec):
        why = framework_reason(plan)
        if running == list(targets):
            assert (why is None) == any(_accepts(plan, t, None) for t in targets), plan.strategy
        note = framework_note(plan)
        assert (note is None) == (why is None)
        if note is not None and "writes it" in note.rsplit("; ", 1)[1] and "no other" not in note:
            writer = note.rsplit("--to ", 1)[1].split()[0]
            assert writer not in targets
            assert plan_target_reason(plan, writer) is None


def test_the_plan_layer_judges_every_launcher_of_every_framework():
    """`LAUNCHERS` are the export targets but `yaml` (which writes any plan), and every
    framework a model may name has its targets among them."""
    from ckplan.model.parts import FRAMEWORKS

    assert set(LAUNCHERS) == set(exports.TARGETS) - {"yaml"}
    assert set(FRAMEWORK_TARGETS) == set(FRAMEWORKS)
    assert all(set(targets) <= set(LAUNCHERS) for targets in FRAMEWORK_TARGETS.values())
