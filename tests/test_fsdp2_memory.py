"""torchtitan's FSDP2 buffers (ckplan.model.frameworks `fsdp2_*`) by hand, against what PyTorch's
FSDPMemTracker measured of torchtitan's own Llama 3 8B on 8 fake ranks
(validation/torch_fsdp2_memory.py; validation/results-fsdp2-memory-torch-2.13.0.json), and
against a rerun of the same measurement at a small shape where torch and torchtitan install.

Llama 3 8B on one GPU of 8 (tp 1): a block holds 4096·(4096 + 2·1024) + 4096² + 3·4096·14336 +
2·4096 = 218,112,000 parameters; the root module the embedding and output (128,256·4096 each)
and the final norm (4096): 1,050,677,248; the output layer and final norm 525,340,672; the
embedding 525,336,576. torchtitan's two FSDP2 groupings (`frameworks.fsdp2_grouping`):
"2024.12" (9dec370's apply_fsdp; the measurement's layout `202412`) and "0.3" (from 83e6941,
torchtitan 0.3.0's apply_fsdp_to_decoder; the measurement's layout `0.3.0`).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip

from ckplan.inputs.presets import load_mapping, spec_from_values
from ckplan.model import frameworks, memory
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.layer_chain import layer_chain

ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads((ROOT / "validation" / "results-fsdp2-memory-torch-2.13.0.json").read_text())
LAYER, ROOT_PARAMS, OUTPUT = 218_112_000, 1_050_677_248, 525_340_672
EMBEDDING = 128_256 * 4096
VERSION_OF_LAYOUT = {"202412": "2024.12", "0.3.0": "0.3"}
DEC_2024 = frameworks.fsdp2_grouping("2024.12")
V0_3 = frameworks.fsdp2_grouping("0.3")


def fsdp2_spec(case=None, **changes):
    base, origin = load_mapping("llama3-8b")
    values = {
        **base,
        "framework": "torchtitan",
        "zero": 3,
        "dp": 8,
        "seq": 8192,
        "micro_batch": 2,
        "optimizer": "adamw",
        "loss": "eager",
    }
    if changes.get("framework", "torchtitan") == "torchtitan":
        values["framework_version"] = "2024.12"
    if case:
        values.update(
            seq=case["seq"],
            micro_batch=case["micro_batch"],
            framework_version=VERSION_OF_LAYOUT[case["layout"]],
        )
    return spec_from_values({**values, **changes}, origin)


def test_llama3_8b_parameter_counts():
    spec = fsdp2_spec()
    assert memory.largest_layer_parameters(spec) == LAYER
    assert memory.output_layer_parameters(spec) == OUTPUT
    dense, expert = memory.stage_parameters(spec, 0)
    assert dense + expert - spec.layers * LAYER == ROOT_PARAMS


def test_embedding_parameters():
    spec = fsdp2_spec()
    assert memory.embedding_parameters(spec) == EMBEDDING == ROOT_PARAMS - OUTPUT
    assert memory.embedding_parameters(spec, 1) == 0


def test_groupings_by_release():
    assert frameworks.FSDP2Grouping(embedding_own_unit=False, last_block_kept=True) == DEC_2024
    assert frameworks.FSDP2Grouping(embedding_own_unit=True, last_block_kept=False) == V0_3
    # 0.3.0 with weight tying: [tok_embeddings, norm, lm_head] one kept unit
    tied = frameworks.fsdp2_grouping("0.3", tied_embeddings=True)
    assert tied == frameworks.FSDP2Grouping(embedding_own_unit=False, last_block_kept=False)
    assert frameworks.fsdp2_grouping(None) == V0_3  # the newest release modelled
    assert frameworks.fsdp2_outer_units(ROOT_PARAMS, EMBEDDING, DEC_2024) == (0, ROOT_PARAMS)
    assert frameworks.fsdp2_outer_units(ROOT_PARAMS, EMBEDDING, V0_3) == (EMBEDDING, OUTPUT)
    assert frameworks.framework_version(fsdp2_spec()) == "2024.12"
    assert frameworks.framework_version(fsdp2_spec(framework_version=None)) == "0.3"
    # hf: transformers' causal-LM loss by release (ckplan.model.loss `shifted_logits`)
    hf = fsdp2_spec(framework="hf", framework_version=None)
    assert frameworks.framework_version(hf) == "5.25"
    # deepspeed: the transformers release of a model the Trainer or accelerate hands to it
    deepspeed = fsdp2_spec(framework="deepspeed", framework_version=None)
    assert frameworks.framework_version(deepspeed) == "5.25"
    # megatron: the Transformer Engine release (ckplan.model.context_parallel `TE_CP_MOVED`)
    megatron = fsdp2_spec(framework="megatron", framework_version=None)
    assert frameworks.framework_version(megatron) == "te2.16"


def test_kept_unsharded_by_hand():
    # 2024.12: bf16 root module and last block: 2 · (1,050,677,248 + 218,112,000)
    assert frameworks.fsdp2_kept_unsharded_bytes(ROOT_PARAMS, LAYER, True) == 2_537_578_496
    # 0.3: the final norm and output alone: 2 · 525,340,672
    assert frameworks.fsdp2_kept_unsharded_bytes(OUTPUT, LAYER, False) == 1_050_681_344
    assert memory.model_state_bytes(fsdp2_spec(framework_version="0.3")).buffers == 1_050_681_344


def test_block_buffers_by_hand():
    # forward: unsharded copy + all-gather output, 2 + 2 bytes a parameter; the kept last block
    # its all-gather output alone
    assert frameworks.fsdp2_layer_forward_bytes(LAYER) == 872_448_000
    assert frameworks.fsdp2_layer_forward_bytes(LAYER, kept=True) == 436_224_000
    # backward, a middle block: running 2 + prefetched 2 + bf16 gradients 2 + the previous
    # block's fp32 reduce-scatter input 4 = 10 bytes a parameter, + the root's bf16 output grads
    assert frameworks.fsdp2_layer_backward_bytes(LAYER, OUTPUT) == (
        10 * 218_112_000 + 2 * 525_340_672
    )
    # the last block (first to run): kept, no reduce-scatter before it: 2 + 2
    assert frameworks.fsdp2_layer_backward_bytes(LAYER, OUTPUT, last=True) == (
        4 * 218_112_000 + 2 * 525_340_672
    )
    # the first block: nothing to prefetch (the root is unsharded): 2 + 2 + 4
    assert frameworks.fsdp2_layer_backward_bytes(LAYER, OUTPUT, first=True) == (
        8 * 218_112_000 + 2 * 525_340_672
    )


def test_block_buffers_by_hand_0_3():
    def backward(**where):
        return frameworks.fsdp2_layer_backward_bytes(
            LAYER, OUTPUT, grouping=V0_3, embedding_params=EMBEDDING, **where
        )

    # a middle block: 2 + 2 + 2 + 4 = 10 bytes a parameter; the output's gradients were
    # reduce-scattered by their own unit before the blocks' backward
    assert backward() == 10 * 218_112_000
    # the last block (first to run), resharded: running 2 + prefetched 2 + gradients 2, and
    # the final norm and output unit's fp32 reduce-scatter input, 4 · 525,340,672
    assert backward(last=True) == 6 * 218_112_000 + 4 * 525_340_672
    # the first block: it prefetches the embedding's all-gather output, 2 · 525,336,576
    assert backward(first=True) == 8 * 218_112_000 + 2 * 525_336_576
    # the embedding's own backward: unsharded 2 + gradient 2, the first block's fp32 input 4
    assert frameworks.fsdp2_embedding_backward_bytes(EMBEDDING, LAYER) == (
        4 * 525_336_576 + 4 * 218_112_000
    )
    # every block's forward: unsharded copy and all-gather output; the embedding's too
    assert frameworks.fsdp2_layer_forward_bytes(EMBEDDING) == 4 * 525_336_576


@pytest.mark.parametrize(
    ("changes", "resharding"),
    [
        ({}, True),
        ({"zero": 2}, False),
        ({"dp": 1}, False),
        ({"dp": 1, "cp": 8}, True),
        ({"framework": "deepspeed"}, False),
    ],
)
def test_which_layouts_reshard(changes, resharding):
    assert frameworks.fsdp2_resharding(fsdp2_spec(**changes)) is resharding


def _added_workspaces(spec):
    """Per stage, the forward and backward workspace bytes torchtitan's FSDP2 adds to the same
    chain under Hugging Face's ZeRO-2 (FSDP1 SHARD_GRAD_OP, whose chain holds no buffers)."""
    # hf at zero 2 (FSDP1 SHARD_GRAD_OP): no buffers in its chain (zero 3 has FSDP1's, fsdp1_*)
    plain = layer_chain(
        spec.replace(framework="hf", zero=2, framework_version=None, fsdp_version=1), ()
    )
    chain = layer_chain(spec, ())
    return (
        [
            a - b
            for a, b in zip(
                chain.forward_workspace_bytes, plain.forward_workspace_bytes, strict=True
            )
        ],
        [
            a - b
            for a, b in zip(
                chain.backward_workspace_bytes, plain.backward_workspace_bytes, strict=True
            )
        ],
    )


def test_chain_holds_the_block_buffers_in_its_layer_stages():
    spec = fsdp2_spec()
    chain = layer_chain(spec, ())
    added_forward, added_backward = _added_workspaces(spec)
    # embedding, 32 blocks, output layer and loss; the output stage's is no FSDP2 buffer but
    # torchtitan 2024.12's eager final norm, its fp32 input and bf16 product beside the input
    # hf's fused one keeps, 2·(2·16,384·4096) + 4·16,384 (`loss.final_norm_saved_bytes`)
    assert added_forward == [0, *[872_448_000] * 31, 436_224_000, 268_500_992]
    middle = 10 * LAYER + 2 * OUTPUT
    assert added_backward == [0, 8 * LAYER + 2 * OUTPUT, *[middle] * 30, 4 * LAYER + 2 * OUTPUT, 0]
    assert layer_chain(spec, ()) is chain  # the replays are cached by chain identity


def test_chain_holds_the_0_3_unit_buffers():
    spec = fsdp2_spec(framework_version="0.3")
    added_forward, added_backward = _added_workspaces(spec)
    # embedding (its own unit), 32 blocks all resharded, output layer and loss
    assert added_forward == [4 * EMBEDDING, *[872_448_000] * 32, 0]
    assert added_backward == [
        4 * EMBEDDING + 4 * LAYER,
        8 * LAYER + 2 * EMBEDDING,
        *[10 * LAYER] * 30,
        6 * LAYER + 4 * OUTPUT,
        0,
    ]


@pytest.mark.parametrize(
    "case",
    [case for case in RESULTS["cases"] if case["layout"] in VERSION_OF_LAYOUT],
    ids=lambda c: f"{c['layout']}-{c['ac']}-{c['seq']}",
)
def test_recorded_measurement_matches_the_model_states(case):
    # (the layout `accelerate`, the Trainer's FSDP2: tests/test_hf_fsdp2.py)
    """The sharded fp32 parameters and AdamW states, the kept bf16 copies at the peak (after
    the forward, with no all-gather or reduce-scatter buffer live) and the last block's
    all-gather output at the forward's peak are ckplan's to the byte."""
    spec = fsdp2_spec(case)
    states = memory.model_state_bytes(spec)
    phases = case["phases"]
    assert case["peak_phase"] == "backward"
    peak = phases["backward"]
    assert peak["Sharded Param"] == states.weights
    # beside AdamW's moments, its fp32 step scalar per parameter tensor: 7 a block, and the
    # embedding, final norm and output
    assert peak["OptState"] - 4 * (spec.layers * 7 + 3) == states.optimizer
    kept = {"202412": 2_537_578_496, "0.3.0": 1_050_681_344}[case["layout"]]
    assert peak["Unsharded Param"] == states.buffers == kept
    assert peak["All Gather"] == peak["Reduce Scatter"] == 0
    # the forward's peak: the last unit gathered, its all-gather output still held (freed at
    # the next copy-in): 2024.12's kept last block, 0.3's final norm and output unit
    last_gathered = {"202412": LAYER, "0.3.0": OUTPUT}[case["layout"]]
    assert phases["forward"]["All Gather"] == frameworks.fsdp2_layer_forward_bytes(
        last_gathered, kept=True
    )
    assert phases["forward"]["Unsharded Param"] == states.buffers


def test_plan_states_at_the_loss_peak():
    spec = fsdp2_spec()
    plan = evaluate(spec, parse_strategy("sac", spec))
    assert plan.model_states.buffers == 2_537_578_496


SMALL = {"dim": 256, "heads": 4, "kv_heads": 2, "ffn": 768, "layers": 4, "vocab": 1024}


def measurement_harness():
    """validation/torch_fsdp2_memory.py as a module, where torch and torchtitan install (else
    the test is skipped)."""
    torch_or_skip()
    framework_or_skip("torchtitan", "FSDP2 buffers not remeasured")
    path = ROOT / "validation" / "torch_fsdp2_memory.py"
    module_spec = importlib.util.spec_from_file_location("torch_fsdp2_memory", path)
    harness = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = harness
    module_spec.loader.exec_module(harness)
    return harness


def test_rerun_at_a_small_shape():
    """The measurement itself, at a small shape of the same structure: the kept copies, the
    last block's all-gather output and the sharded states, by hand."""
    harness = measurement_harness()
    case = {"layout": "202412", "ac": "op", "micro_batch": 2, "seq": 128}
    result = harness.measure(case, SMALL)
    dim, kv_dim = 256, 2 * 64
    layer = dim * (dim + 2 * kv_dim) + dim * dim + 3 * dim * 768 + 2 * dim  # 884,224
    root = 2 * 1024 * dim + dim  # 524,544
    total = 4 * layer + root
    peak = result["phases"][result["peak_phase"]]
    assert result["peak_phase"] == "backward"
    assert peak["Unsharded Param"] == frameworks.fsdp2_kept_unsharded_bytes(root, layer, True)
    assert result["phases"]["forward"]["All Gather"] == frameworks.fsdp2_layer_forward_bytes(
        layer, kept=True
    )
    assert peak["Sharded Param"] == 4 * total // 8


def test_stream_pools_by_hand():
    # the 8 ranks' sharded fp32 gradients (4 · 8,030,261,248 / 8) and the all-gather pool
    spec = fsdp2_spec()
    gradients = 4_015_130_624
    assert memory.model_state_bytes(spec).gradients == gradients
    assert frameworks.fsdp2_stream_pool_bytes(gradients, 7) == gradients + 7
    for version, before, after in (("2024.12", ROOT_PARAMS, 0), ("0.3", EMBEDDING, OUTPUT)):
        for expandable in (True, False):
            changed = spec.replace(framework_version=version, expandable_segments=expandable)
            pool = frameworks.fsdp2_all_gather_pool_bytes(before, LAYER, after, 32, 8, expandable)
            assert memory.stream_pool_bytes(changed) == gradients + pool
    # zero 2 gathers in forward alone, in the same order
    zero2 = spec.replace(zero=2)
    assert memory.stream_pool_bytes(zero2) == memory.stream_pool_bytes(spec)
    hf = spec.replace(framework="hf", framework_version=None)  # transformers 5.25: FSDP2
    assert memory.stream_pool_bytes(hf.replace(fsdp_version=1)) == 0
    # accelerate's FSDP2 units are torchtitan 0.3's; its fp32 parameters shard fp32 gradients
    pool = frameworks.fsdp2_all_gather_pool_bytes(EMBEDDING, LAYER, OUTPUT, 32, 8, False)
    assert memory.stream_pool_bytes(hf) == gradients + pool
    assert memory.stream_pool_bytes(spec.replace(dp=1)) == 0


def test_all_gather_pool_with_expandable_segments():
    # the root's shard cast below its output, then the root's and the first block's outputs
    # alive together (AllGatherState): 2 · (1,050,677,248 / 8 + 1,050,677,248 + 218,112,000)
    assert frameworks.fsdp2_all_gather_pool_bytes(ROOT_PARAMS, LAYER, 0, 32, 8) == 2 * (
        131_334_656 + ROOT_PARAMS + LAYER
    )
    # 0.3: the embedding and the first block, or the last block and the [norm, output] unit
    assert frameworks.fsdp2_all_gather_pool_bytes(EMBEDDING, LAYER, OUTPUT, 32, 8) == 2 * (
        65_667_072 + OUTPUT + LAYER
    )
    # no unit outside the blocks: two blocks
    assert frameworks.fsdp2_all_gather_pool_bytes(0, 10, 0, 4, 2) == 2 * (5 + 20)
    assert frameworks.fsdp2_all_gather_pool_bytes(0, 10, 0, 1, 2) == 2 * (5 + 10)
    assert frameworks.fsdp2_all_gather_pool_bytes(0, 0, 0, 0, 8) == 0


def test_all_gather_pool_with_the_default_allocator():
    from ckplan.model.allocator import segment_bytes

    def pool(before, layer, after, blocks):
        return frameworks.fsdp2_all_gather_pool_bytes(before, layer, after, blocks, 8, False)

    # 2024.12: the root's cast, the root's output, the first block's: a segment each
    assert pool(ROOT_PARAMS, LAYER, 0, 32) == (
        segment_bytes(2 * 131_334_656) + segment_bytes(2 * ROOT_PARAMS) + segment_bytes(2 * LAYER)
    )
    # 0.3: the embedding's V·h bf16 output is a whole number of 2 MiB blocks, and the [norm,
    # output] unit asks for 2·h bytes more: a segment of its own whatever the block count
    assert segment_bytes(2 * EMBEDDING) == 2 * EMBEDDING < segment_bytes(2 * OUTPUT)
    base = segment_bytes(2 * 65_667_072) + 2 * EMBEDDING + segment_bytes(2 * LAYER)
    assert pool(EMBEDDING, LAYER, OUTPUT, 32) == base + segment_bytes(2 * OUTPUT)
    assert pool(EMBEDDING, LAYER, OUTPUT, 31) == base + segment_bytes(2 * OUTPUT)
    # a unit after the blocks that fits the first unit's segment takes it when the last block
    # sits in the block segment (odd count), not when it sits in the first unit's (even)
    mib = 2**20
    first, block, last = 50 * mib, 20 * mib, 40 * mib  # parameters: 100, 40, 80 MiB in bf16
    cast = segment_bytes(2 * first // 8)
    assert pool(first, block, last, 3) == cast + 100 * mib + 40 * mib
    assert pool(first, block, last, 4) == cast + 100 * mib + 40 * mib + 80 * mib
    # a pipeline stage past the first: two block segments, then the last unit's
    assert pool(0, block, last, 8) == segment_bytes(2 * block // 8) + 80 * mib + 80 * mib
    assert pool(0, block, 15 * mib, 8) == segment_bytes(2 * block // 8) + 80 * mib


def test_stream_pools_of_a_pipeline_stage():
    # pp 4: the busiest stage is the first or the last, 8 layers and the embedding or output
    spec = fsdp2_spec(pp=4)
    stage = memory.busiest_stage(spec)
    dense, expert = memory.stage_parameters(spec, stage)
    gradients = memory.model_state_bytes(spec, stage).gradients
    root = dense + expert - 8 * LAYER
    assert root in (128_256 * 4096, 128_256 * 4096 + 4096)
    pool = frameworks.fsdp2_all_gather_pool_bytes(root, LAYER, 0, 8, 8)
    assert memory.stream_pool_bytes(spec) == gradients + pool


def test_reserved_adds_the_stream_pools_in_whole_blocks():
    from ckplan.model import allocator

    spec = fsdp2_spec()
    plan = evaluate(spec, parse_strategy("sac", spec))
    pools = memory.stream_pool_bytes(spec)
    without = allocator.reserved_bytes(plan.total_bytes, True)
    block = allocator.ROUND_LARGE
    # the eager loss's bf16 logits' idle block besides (expandable segments), 2·b·s·V
    idle = 2 * 2 * 8192 * 128256
    assert plan.reserved_bytes == without + -(-pools // block) * block + idle
    assert allocator.reserved_bytes(0, True, 1) == block
    # under pressure the pools give way first, never below the allocated blocks
    assert allocator.reserved_within(3 * block, 4 * block, True, 10 * block) == 4 * block
