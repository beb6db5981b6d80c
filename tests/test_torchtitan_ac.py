"""Which per-op policy each torchtitan release runs (ckplan.model.torchtitan_ac): the policy the
sweep and `plan` try under torchtitan is exactly the one the torchtitan export writes for the
default release, on every combination of the keys that decide it (brute force over a grid)."""

import itertools

import pytest
from test_op_policy import SMALL
from test_op_policy_moe_mla import BASE as MOE
from test_op_policy_moe_mla import MLA

from ckplan import exports
from ckplan.model import torchtitan_ac
from ckplan.model.op_policy import TORCHTITAN_03_POLICY, TORCHTITAN_POLICY
from ckplan.model.spec import SpecError, spec_from_mapping
from ckplan.plan.evaluate import evaluate
from ckplan.plan.search import candidate_strategies, policy_word, sweep_policy
from ckplan.plan.strategies import StrategyError, parse_strategy

# the keys `policy_reason`, `policy_fit_reason` and `check_policy_model` read
GRID = {
    "bias": [False, True],
    "precision": ["bf16", "float8"],
    "kernels": ["eager", "compiled"],
    "attention": ["flash", "standard"],
    "shape": ["dense", "moe", "mla"],
    "tp": [1, 2],
}


def _specs():
    for values in itertools.product(*GRID.values()):
        keys = dict(zip(GRID, values, strict=True))
        shape = keys.pop("shape")
        keys["sp"] = keys["tp"] > 1
        base = {
            "dense": {**SMALL, "layers": 4, "vocab": 128},
            "moe": {**MOE, "layers": 4, "vocab": 128},
            "mla": {**MOE, **MLA, "layers": 4, "vocab": 128},
        }[shape]
        try:
            yield spec_from_mapping({**base, **keys})
        except SpecError:
            continue


def _exportable(spec, word: str, version: str) -> bool:
    try:
        plan = evaluate(spec, parse_strategy(word, spec))
    except StrategyError:
        return False
    return exports.why_not(plan, "torchtitan", version=version) is None


def test_the_swept_policy_is_the_one_the_default_release_exports():
    seen = set()
    for spec in _specs():
        policy = sweep_policy(spec)
        seen.add(policy)
        # the export refuses sac for 0.3 everywhere: the sweep never offers it under torchtitan
        assert not _exportable(spec, "sac", "0.3")
        assert policy in (None, TORCHTITAN_03_POLICY)
        assert (policy is not None) == _exportable(spec, "sac-fused", "0.3"), spec
        names = {strategy.name for strategy in candidate_strategies(spec)}
        assert ("sac-fused" in names) == (policy is not None)
        assert not any(name == "sac" or name.startswith(("sac+", "sac:")) for name in names)
        # 0.2.x runs sac where the model's policies apply and writes no sac-fused
        assert torchtitan_ac.release_policy(spec, "0.2") in (None, TORCHTITAN_POLICY)
        assert (torchtitan_ac.release_policy(spec, "0.2") is not None) == _exportable(
            spec, "sac", "0.2"
        )
        assert not _exportable(spec, "sac-fused", "0.2")
    assert seen == {None, TORCHTITAN_03_POLICY}  # the grid reaches both answers


@pytest.mark.parametrize(
    ("changes", "word"),
    [
        ({}, "sac-fused"),
        ({"bias": True}, None),  # 0.3.0 saves every aten.addmm
        ({"precision": "float8"}, None),  # and every aten._scaled_mm
        ({"framework": "hf"}, "sac"),  # the torch export runs 0.2's list on HF layers
        ({"framework": "megatron"}, None),  # no per-op policies
        ({"tp": 2, "sp": True}, None),  # sac-fused measured at tp 1 only
        ({"tp": 2, "sp": True, "framework": "hf"}, None),  # HF runs no tensor parallelism
        ({"kernels": "compiled"}, "sac-fused"),
    ],
)
def test_policy_word_by_framework(changes, word):
    try:
        spec = spec_from_mapping({**SMALL, "layers": 4, "bias": False, **changes})
    except SpecError:
        assert changes.get("framework") == "hf"  # the model refuses the layout itself
        return
    assert policy_word(spec) == word


def test_sac_fused_beside_tensor_parallelism_is_refused_in_one_line():
    spec = spec_from_mapping({**SMALL, "layers": 4, "bias": False, "tp": 2, "sp": True})
    with pytest.raises(StrategyError, match=r"one rank's block \(tp: 1\)") as error:
        parse_strategy("sac-fused", spec)
    assert "\n" not in str(error.value)
    assert torchtitan_ac.release_policy(spec) is None
    assert torchtitan_ac.release_policy(spec, "0.2") == TORCHTITAN_POLICY
