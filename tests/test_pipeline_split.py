"""Uneven pipelines: Megatron's first/last stage layers and the embedding and loss counted as
layers of the split (--account-for-embedding-in-pipeline-split / -loss-), which Llama 3's 126
layers over 16 stages use (Llama 3 paper §3.3.2: "we reduce one Transformer layer each from the
first and the last stages")."""

import pytest

from ckplan.model import memory
from ckplan.model.layers import stage_layer_indices
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, parse_strategy

BOTH = {
    "account_for_embedding_in_pipeline_split": True,
    "account_for_loss_in_pipeline_split": True,
}


def test_llama3_405b_pp16_split(spec_of):
    """126 + 2 = 128 items over 16 stages: 8 each, the first and the last one layer fewer."""
    spec = spec_of("llama3-405b", tp=8, sp=True, pp=16, **BOTH)
    assert spec.stage_layer_counts == (7, *(8,) * 14, 7)
    assert spec.layers_per_stage == 8
    assert stage_layer_indices(spec, 0) == tuple(range(7))
    assert stage_layer_indices(spec, 1) == tuple(range(7, 15))
    assert stage_layer_indices(spec, 15) == tuple(range(119, 126))
    # the same stages as first_stage_layers / last_stage_layers give
    explicit = spec_of(
        "llama3-405b", tp=8, sp=True, pp=16, first_stage_layers=7, last_stage_layers=7
    )
    assert explicit.stage_layer_counts == spec.stage_layer_counts


def test_only_the_embedding_counted(spec_of):
    """80 + 1 = 81 items over 3 stages: 27 each, the first 26."""
    spec = spec_of("llama3-70b", pp=3, account_for_embedding_in_pipeline_split=True)
    assert spec.stage_layer_counts == (26, 27, 27)
    assert [stage_layer_indices(spec, k)[0] for k in range(3)] == [0, 26, 53]


def test_interleaved_chunks_cut_embedding_layers_loss(spec_of):
    """With v virtual stages the chunks of 128/(16·v) items cut [E, 0..125, L] (Megatron's
    get_transformer_layer_offset): at v 8 each chunk is one item, stage 0's first chunk is the
    embedding alone and stage 15's last the loss alone (as Llama 3 describes)."""
    spec = spec_of("llama3-405b", tp=8, sp=True, pp=16, virtual_stages=8, **BOTH)
    assert stage_layer_indices(spec, 0) == (15, 31, 47, 63, 79, 95, 111)
    assert stage_layer_indices(spec, 1) == (0, 16, 32, 48, 64, 80, 96, 112)
    assert stage_layer_indices(spec, 15) == (14, 30, 46, 62, 78, 94, 110)
    every = sorted(i for k in range(16) for i in stage_layer_indices(spec, k))
    assert every == list(range(126))
    v2 = spec.replace(virtual_stages=2)  # chunks of 4: stage 0 holds E,0,1,2 and 63..66
    assert stage_layer_indices(v2, 0) == (0, 1, 2, 63, 64, 65, 66)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pp": 1}, "needs pipeline parallelism"),
        ({"pp": 5}, "must divide layers \\+ embedding \\+ loss \\(128\\)"),
        ({"pp": 64, "virtual_stages": 4}, "must divide the 2 layers per pipeline stage"),
        ({"pp": 128}, "leave no transformer layer"),
        ({"pp": 16, "first_stage_layers": 7}, "drop account_for_embedding_in_pipeline_split"),
    ],
)
def test_split_errors(spec_of, changes, message):
    with pytest.raises(SpecError, match=message):
        spec_of("llama3-405b", **BOTH, **changes)


def test_pp_not_dividing_layers_names_both_ways(spec_of):
    with pytest.raises(SpecError, match="account_for_embedding_in_pipeline_split"):
        spec_of("llama3-405b", pp=16)


def test_evaluate_uneven_first_stage_has_embedding(spec_of):
    """Stage 0 holds 7 layers and the embedding with 16 micro-batches in flight; the last 7
    layers and the output layer with one. The plan reports the stage whose states and
    activations peak, and its states."""
    spec = spec_of("llama3-405b", tp=8, sp=True, pp=16, dp=8, zero=1, microbatches=16, **BOTH)
    plan = evaluate(spec, parse_strategy("none", spec))
    assert plan.peak_stage == 1  # 8 layers with 15 micro-batches beat 7 with 16
    assert plan.model_states == memory.model_state_bytes(spec, 1)
    assert "peak on pipeline stage 1, 15 micro-batches in flight" in plan.notes
    assert [k for k, _ in plan.stage_forwards] == [0, 1, 15]
