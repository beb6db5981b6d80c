"""Multi-token prediction (mtp_layers): DeepSeek-V3 §2.2's MTP depth as Megatron-Core's
MultiTokenPredictionLayer runs it, on the stage that holds the loss."""

import pytest

from ckplan.model import memory, mtp
from ckplan.model.flops import layer_forward_flops, logits_forward_flops, model_flops_per_iteration
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.layer_chain import layer_chain, layer_stage_costs, stage_names

DSV3 = {"tp": 2, "sp": True, "ep": 8, "dp": 8, "microbatches": 16}
LAYOUT = "Et|(tt|)*30mL"  # Megatron-Bridge's H100 DeepSeek-V3 layout: pp 8, v 4


def deepseek(spec_of, **changes):
    return spec_of("deepseek-v3", **{**DSV3, **changes})


def test_parameters_of_one_depth(spec_of):
    """A block of the last layer's kind (MoE with MLA), eh_proj 2h x h, three RMSNorms."""
    spec = deepseek(spec_of, mtp_layers=1)
    h = spec.hidden
    block = memory.layer_parameter_parts(spec, mtp.mtp_kind(spec)).total
    assert mtp.mtp_kind(spec).moe
    assert memory.mtp_parameters(spec) == block + 2 * h * h + 3 * h == 11_610_068_224
    plain = deepseek(spec_of)
    assert memory.parameter_count(spec).total == (
        memory.parameter_count(plain).total + memory.mtp_parameters(spec)
    )


def test_last_stage_holds_the_depth_and_an_embedding_copy(spec_of):
    spec = deepseek(spec_of, pp=8, pipeline_layout=LAYOUT, mtp_layers=1)
    plain = deepseek(spec_of, pp=8, pipeline_layout="Et|(tt|)*30L")
    block = memory.layer_parameter_parts(spec, mtp.mtp_kind(spec))
    words = -(-spec.vocab * spec.hidden // spec.tp)
    dense, expert = memory.stage_parameters(spec, 7)
    plain_dense, plain_expert = memory.stage_parameters(plain, 7)
    projection = -(-2 * spec.hidden * spec.hidden // spec.tp) + 3 * spec.hidden
    assert dense - plain_dense == block.dense_per_rank(spec) + projection + words
    assert expert - plain_expert == block.experts_per_rank(spec)
    assert memory.stage_parameters(spec, 0) == memory.stage_parameters(plain, 0)


def test_chain_runs_the_depth_before_the_heads(spec_of):
    spec = deepseek(spec_of, pp=8, pipeline_layout=LAYOUT, mtp_layers=1)
    plain = deepseek(spec_of, pp=8, pipeline_layout="Et|(tt|)*30L")
    chain, base = layer_chain(spec, (), stage=7), layer_chain(plain, (), stage=7)
    assert stage_names(spec, stage=7)[-2:] == ["mtp 0", "output+loss"]
    assert chain.length == base.length + 1
    forward, backward, tape, _ = layer_stage_costs(spec, mtp.mtp_kind(spec), ())
    tokens = spec.seq * spec.micro_batch
    projection = 2 * tokens * 2 * spec.hidden * (spec.hidden // spec.tp)
    assert projection == mtp.projection_forward_flops(spec)
    assert chain.forward_flops[-2] == forward + projection
    assert chain.backward_flops[-2] == backward + 2 * projection
    stream = memory.layer_input_bytes(spec)
    ids = memory.token_id_bytes(spec)
    # the ids, enorm's and hnorm's inputs, eh_proj's (two streams), final_layernorm's
    assert chain.tape_bytes[-2] == tape + ids + 5 * stream
    # the heads: the main and the depth's, each the shared output layer and a loss
    assert chain.forward_flops[-1] == 2 * base.forward_flops[-1]
    assert chain.tape_bytes[-1] == 2 * base.tape_bytes[-1]
    # inputs: the depth reads the main hidden state; the heads read it and the depth's
    assert chain.input_bytes[-3:] == (stream, 2 * stream, 0)


def test_model_flops_count_the_depth_as_megatron_does(spec_of):
    """training.py num_floating_point_operations (core_v0.14.0): the MTP layers as layers of
    their kind, 3·2·h·2h for eh_proj, the logits (1 + D) times."""
    spec, plain = deepseek(spec_of, mtp_layers=1), deepseek(spec_of)
    from ckplan.model.flops import _whole_model

    whole = _whole_model(spec)
    per_sequence = 3 * (
        layer_forward_flops(whole, mtp.mtp_kind(whole))
        + 2 * spec.seq * 2 * spec.hidden * spec.hidden
        + logits_forward_flops(whole)
    )
    assert model_flops_per_iteration(spec, 4) - model_flops_per_iteration(plain, 4) == (
        4 * per_sequence
    )


def test_time_of_the_last_stage_grows_by_the_depth(spec_of):
    from ckplan.hardware.step_time import chain_stage_times, layer_time, mtp_time, output_time
    from ckplan.inputs.gpus import load_gpu

    spec = deepseek(spec_of, pp=8, pipeline_layout=LAYOUT, mtp_layers=1)
    gpu = load_gpu("h100-sxm")
    times = chain_stage_times(spec, gpu, 7, ())
    assert times[-2] == mtp_time(spec, gpu, ())
    block = layer_time(spec, gpu, mtp.mtp_kind(spec), ())
    assert times[-2].forward.matmul > block.forward.matmul
    assert times[-1].forward.matmul == pytest.approx(2 * output_time(spec, gpu).forward.matmul)


def test_plan_and_export(spec_of):
    from megatron_args import parse, validate

    from ckplan import exports

    spec = deepseek(spec_of, pp=8, pipeline_layout=LAYOUT, mtp_layers=1, dp=64, ep=64)
    plan = evaluate(spec, parse_strategy("full", spec))
    text = exports.export(plan, "megatron").text
    args = validate(parse(text, spec.tp * spec.pp * spec.dp))
    assert args.mtp_num_layers == 1 and args.pipeline_model_parallel_layout == LAYOUT
    assert "--recompute-num-layers 1" in text
    why = exports.why_not(evaluate(spec, parse_strategy("uniform:2", spec)), "megatron")
    assert "--recompute-num-layers 1" in why
    assert "multi-token prediction" in exports.why_not(plan, "torch")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pipeline_layout": LAYOUT}, "places 1 MTP layers \\(m\\) but mtp_layers is 0"),
        ({"pipeline_layout": "Et|(tt|)*30L", "mtp_layers": 1}, "places 0 MTP layers"),
        ({"pipeline_layout": "Et|(tt|)*29,mt|tL", "mtp_layers": 1}, "before the MTP layers"),
        # chunk 23: rank 7's third of four chunks
        ({"pipeline_layout": "Et|(ttt|)*16(tt|)*6m|(|)*7L", "mtp_layers": 1}, "outside its last"),
        # chunk 30 of 32 on pp 16: rank 14's last chunk, the loss on rank 15
        (
            {"pipeline_layout": "Et|(tt|)*27(ttt|)*2m|L", "mtp_layers": 1, "pp": 16},
            "in the chunk of the loss",
        ),
    ],
)
def test_layout_mtp_rules(spec_of, changes, message):
    with pytest.raises(SpecError, match=message):
        deepseek(spec_of, **{"pp": 8, **changes})


def test_mtp_needs_a_vocabulary(spec_of):
    with pytest.raises(SpecError, match="key 'mtp_layers' needs a transformer"):
        spec_of("gpt2", vocab=0, mtp_layers=1)
