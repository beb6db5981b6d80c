"""PyTorch FSDP1's buffers under the Hugging Face Trainer (ckplan.model.frameworks `fsdp1_*`) by
hand, and against what the PyTorch profiler measured of a small transformers LlamaForCausalLM
under FSDP1 on 8 fake ranks (validation/torch_fsdp1_memory.py;
validation/results-fsdp1-memory-torch-2.13.0.json).

The measured model (hidden 256, FFN 512, 4 heads of 64, 2 KV heads, vocabulary 6000, untied):
a decoder layer holds 256·(256 + 2·128) + 256² + 3·256·512 + 2·256 = 590,336 parameters; the
root unit the embedding and the output layer (6000·256 each) and the final norm (256):
3,072,256; the output layer with the final norm (`memory.output_layer_parameters`) 1,536,256.
The measurement lists blocks of 100,000 bytes or more: the final norm's gradient (512 bytes)
is not among them.
"""

import json
from pathlib import Path

from ckplan.inputs.presets import load_mapping, spec_from_values
from ckplan.model import finetune, frameworks, memory
from ckplan.plan.layer_chain import layer_chain

ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads((ROOT / "validation" / "results-fsdp1-memory-torch-2.13.0.json").read_text())
SMALL = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "vocab": 6000}
LAYER, ROOT_PARAMS, OUTPUT, EMBEDDING = 590_336, 3_072_256, 1_536_256, 1_536_000
NORM = 256


def _small_spec(**changes):
    base, origin = load_mapping("llama3-8b")
    values = {
        **base,
        "hidden": SMALL["hidden"],
        "ffn_hidden": SMALL["ffn"],
        "heads": SMALL["heads"],
        "kv_heads": SMALL["kv_heads"],
        "vocab": SMALL["vocab"],
        "layers": 4,
        "seq": 128,
        "micro_batch": 4,
        "framework": "hf",
        "fsdp_version": 1,  # FSDP1 (the Trainer's default before transformers v5.10.1)
        "zero": 3,
        "dp": 8,
        "loss": "eager",
    }
    return spec_from_values({**values, **changes}, origin)


def _blocks(phase: str) -> dict[int, int]:
    return {int(size): n for size, n in RESULTS["peaks"][phase]["blocks"].items()}


def test_small_parameter_counts():
    spec = _small_spec()
    assert RESULTS["shape"] | SMALL == RESULTS["shape"]
    assert memory.largest_layer_parameters(spec) == LAYER
    assert memory.output_layer_parameters(spec) == OUTPUT
    assert memory.embedding_parameters(spec) == EMBEDDING
    assert memory.outside_layer_parameters(spec, 0) == ROOT_PARAMS


def test_selects_the_trainers_fsdp_only():
    assert frameworks.fsdp1_resharding(_small_spec())
    assert not frameworks.fsdp1_resharding(_small_spec(zero=2))
    assert not frameworks.fsdp1_resharding(_small_spec(dp=1))
    assert not frameworks.fsdp1_resharding(_small_spec(framework="torchtitan", fsdp_version=None))
    # transformers v5.25's Trainer builds FSDP2 unless fsdp_config says version 1
    assert not frameworks.fsdp1_resharding(_small_spec(fsdp_version=None))
    assert frameworks.fsdp1_resharding(_small_spec(fsdp_version=None, framework_version="4.44"))


def test_root_copy_kept_through_loss_and_backward():
    kept = frameworks.fsdp1_kept_unsharded_bytes(ROOT_PARAMS)
    assert kept == 6_144_512
    for phase in ("forward", "loss", "backward", "layers_backward"):
        assert _blocks(phase)[kept] == 1, phase
    assert memory.model_state_bytes(_small_spec()).buffers == kept
    # freed with the backward: the optimizer step holds none
    assert kept not in _blocks("step")


def test_layer_backward_holds_one_layer_and_the_waiting_output_gradient():
    blocks = _blocks("layers_backward")
    assert blocks[2 * LAYER] == 1  # the running layer's unsharded copy, none prefetched
    # the output layer's bf16 gradient waits for the root's (the final norm's beside it)
    assert blocks[2 * (OUTPUT - NORM)] == 1
    assert frameworks.fsdp1_layer_forward_bytes(LAYER) == 2 * LAYER
    assert frameworks.fsdp1_layer_backward_bytes(LAYER, OUTPUT) == 4 * LAYER + 2 * OUTPUT


def test_embedding_backward_forms_the_root_gradient():
    blocks = _blocks("embedding_backward")
    kept = frameworks.fsdp1_kept_unsharded_bytes(ROOT_PARAMS)
    beyond = frameworks.fsdp1_embedding_backward_bytes(ROOT_PARAMS, EMBEDDING, OUTPUT)
    # the kept copy and the flat gradient (both 6,144,512), the two V x h bf16 gradients
    assert blocks[kept] == 2 and blocks[2 * (OUTPUT - NORM)] == 2
    assert kept + beyond == 2 * 6_144_512 + 2 * 3_072_000 + 2 * NORM
    # the layers' fp32 gradient shards are there already, the root's not yet
    assert blocks[4 * LAYER // 8] == 4 and 4 * ROOT_PARAMS // 8 not in blocks


def _minus(these, those) -> list[int]:
    return [a - b for a, b in zip(these, those, strict=True)]


def test_chain_holds_the_buffers_in_workspaces():
    spec, alone = _small_spec(), _small_spec(dp=1)
    chain, plain = layer_chain(spec, False), layer_chain(alone, False)
    forward = _minus(chain.forward_workspace_bytes, plain.forward_workspace_bytes)
    backward = _minus(chain.backward_workspace_bytes, plain.backward_workspace_bytes)
    layers = slice(1, 1 + spec.layers)
    assert forward[layers] == [2 * LAYER] * spec.layers
    assert backward[layers] == [4 * LAYER + 2 * OUTPUT] * spec.layers
    assert backward[0] == 2 * (ROOT_PARAMS + EMBEDDING + OUTPUT)
    assert forward[-1] == backward[-1] == 0  # the output stage: the root's copy is kept


def test_root_gradient_shard_after_the_backward():
    grads = memory.chain_gradient_bytes(_small_spec())
    assert grads[0] == grads[-1] == 0
    assert grads[1:-1] == (4 * LAYER // 8,) * 4


def _full_plan():
    from ckplan.plan import evaluate, parse_strategy

    spec = _small_spec(framework_version="4.44")  # transformers v4.43.0's loss, as 4.44.0's
    return evaluate(spec, parse_strategy("full", spec))


def test_plan_peak_against_the_measured_loss_peak():
    # beyond the fp32 weight shards and AdamW's states (alive before the step), ckplan's peak
    # (the eager loss with the shifted copy, the root's copy kept) is the measured one to 1 %:
    # 44,585,472 against 44,973,800 bytes
    plan = _full_plan()
    states = plan.model_states
    beyond = plan.total_bytes - states.weights - states.optimizer
    measured = RESULTS["peaks"]["loss"]["bytes"]
    assert states.gradients == 0 and states.buffers == 6_144_512
    assert abs(beyond / measured - 1) < 0.01


def test_plan_embedding_backward_against_the_measurement():
    # the embedding's backward, the chain's last step: its workspace, the root's kept copy and
    # every layer's fp32 gradient shard, to 2 % of the measured 19,672,296 bytes
    from ckplan.plan.timeline import memory_timeline

    plan = _full_plan()
    during = memory_timeline(plan).during_bytes[-1]
    shards = sum(memory.chain_gradient_bytes(plan.spec))
    measured = RESULTS["peaks"]["embedding_backward"]["bytes"]
    assert abs((during + plan.model_states.buffers + shards) / measured - 1) < 0.02


# PEFT's FSDP-QLoRA recipe over the same model, measured with LoRA r 8 on every linear of the
# decoder layers, the base and the adapters in bf16 (validation/torch_fsdp1_memory.py --lora;
# validation/results-fsdp1-lora-memory-torch-2.13.0.json)
LORA_RESULTS = json.loads(
    (ROOT / "validation" / "results-fsdp1-lora-memory-torch-2.13.0.json").read_text()
)
# one layer's adapters: r (in + out) over q, o (256 + 256), k, v (256 + 128), gate, up, down
# (256 + 512)
ADAPTERS = 8 * (2 * 512 + 2 * 384 + 3 * 768)


def _lora_spec(**changes):
    keys = {"training": "lora", "lora_targets": "all-linear", "lora_rank": 8}
    dtypes = {"weight_bytes": 2, "grad_bytes": 2, "master_bytes": 0, "optimizer_bytes": 4}
    return _small_spec(**keys, **dtypes, **changes)


def _lora_blocks(phase: str) -> dict[int, int]:
    return {int(size): n for size, n in LORA_RESULTS["peaks"][phase]["blocks"].items()}


def test_lora_resharding_keeps_the_root_and_gathers_one_frozen_layer():
    """Frozen weights under FSDP1: the root's bf16 copy kept through the layers' backward,
    one decoder layer's gathered copy at a time, and neither the output layer's gradient nor a
    layer's: the frozen FlatParameters get none."""
    spec = _lora_spec()
    assert frameworks.fsdp1_resharding(spec)
    assert finetune.lora_layer_parameters(spec) == ADAPTERS
    assert LORA_RESULTS["trainable"] * 8 == 4 * ADAPTERS  # the flat shards of 8 ranks
    blocks = _lora_blocks("layers_backward")
    kept = frameworks.fsdp1_kept_unsharded_bytes(ROOT_PARAMS)
    assert blocks[kept] == 1 and blocks[2 * LAYER] == 1
    assert 2 * (OUTPUT - NORM) not in blocks and 4 * LAYER // 8 not in blocks
    assert memory.model_state_bytes(spec).buffers == kept


def test_lora_chain_holds_the_gathered_frozen_layer():
    """ckplan's layer workspace is the gathered layer as `finetune.gathered_layer_bytes` counts
    it: the frozen linears and all the layer's adapters in bf16, not its norms. PEFT's policy
    makes each adapter its own unit, gathered one at a time, so the measured layer block is the
    frozen linears and norms alone: ckplan's is larger by the adapters less the norms."""
    spec, alone = _lora_spec(), _lora_spec(dp=1)
    chain, plain = layer_chain(spec, False), layer_chain(alone, False)
    forward = _minus(chain.forward_workspace_bytes, plain.forward_workspace_bytes)
    backward = _minus(chain.backward_workspace_bytes, plain.backward_workspace_bytes)
    layers = slice(1, 1 + spec.layers)
    gathered = 2 * (LAYER - 2 * 256) + 2 * ADAPTERS
    assert forward[layers] == [gathered] * spec.layers
    assert backward[layers] == [gathered + 2 * ADAPTERS] * spec.layers
    assert gathered - 2 * LAYER == 2 * ADAPTERS - 2 * 2 * 256
    assert forward[0] == backward[0] == forward[-1] == backward[-1] == 0


def test_lora_plan_peak_against_the_measured_loss_peak():
    # beyond the frozen weights' shards and AdamW's states, ckplan's peak (the eager loss with
    # the shifted copy, the root's copy kept) is the measured one to 0.3 %: 44,323,328 against
    # 44,449,512 bytes
    from ckplan.plan import evaluate, parse_strategy

    spec = _lora_spec(framework_version="4.44")
    plan = evaluate(spec, parse_strategy("full", spec))
    states = plan.model_states
    beyond = plan.total_bytes - states.weights - states.optimizer
    measured = LORA_RESULTS["peaks"]["loss"]["bytes"]
    assert abs(beyond / measured - 1) < 0.005


PREFETCH_RESULTS = json.loads(
    (ROOT / "validation" / "results-fsdp1-backward-pre-memory-torch-2.13.0.json").read_text()
)


def test_backward_pre_holds_the_layer_before_in_a_layers_backward():
    """With backward_prefetch BACKWARD_PRE (accelerate's `fsdp_backward_prefetch`) the layers'
    backward peak holds two layers' unsharded copies, the running one's and the prefetched
    one's; ckplan adds the second to every layer's backward but the first layer's, whose next
    unit is the root, kept unsharded already."""
    blocks = {
        int(size): n for size, n in PREFETCH_RESULTS["peaks"]["layers_backward"]["blocks"].items()
    }
    assert blocks[2 * LAYER] == 2 and _blocks("layers_backward")[2 * LAYER] == 1
    spec = _small_spec(fsdp_backward_prefetch="backward_pre")
    assert frameworks.fsdp1_prefetched_layers(spec) == 1
    assert (
        frameworks.fsdp1_prefetched_layers(_small_spec(fsdp_backward_prefetch="backward_post")) == 0
    )
    chain, plain = layer_chain(spec, False), layer_chain(_small_spec(), False)
    extra = _minus(chain.backward_workspace_bytes, plain.backward_workspace_bytes)
    assert extra == [0, 0] + [2 * LAYER] * (spec.layers - 1) + [0]
    assert chain.forward_workspace_bytes == plain.forward_workspace_bytes
