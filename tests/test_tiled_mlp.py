"""TiledMLP (`mlp_tiles`; Bekman et al. 2025, ALST): the recomputed MLP's backward by hand on
Llama 3 8B at 64k tokens, the strategies it implies, its refusals and the sweep's note. The
walk is measured against PyTorch in tests/test_tiled_mlp_torch.py."""

import pytest

from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.memory import layer_backward_walk, selective_activation_bytes_per_layer
from ckplan.model.spec import SpecError
from ckplan.plan.search import sweep, tiled_mlp_note, tiled_mlp_tiles
from ckplan.plan.strategies import parse_strategy

MIB = 2**20


def llama(**changes):
    return load_spec("llama3-8b", {"seq": 65536, **changes})


def test_tiles_divide_the_rebuilt_mlp_by_hand():
    """T = 65,536 tokens, h 4096, F 14,336, bf16: X = T·h·2 = 512 MiB. The MLP's re-forward
    rebuilds fc1's input (X), fc1's [gate | up] output (2F·T·2 = 3584 MiB) and the SwiGLU
    output fc2 reads (F·T·2 = 1792 MiB): 5888 MiB whole, 1472 MiB a tile of four. Beside the
    rest of the tape and the kept MLP input (3336 MiB): fc2's backward holds 3336 + 1472; its
    gradients are δ_out (X), x_grad = zeros_like(x) (X) and fc2's tile input gradient (1792/4).
    At act: fc2's tile tensors (448) freed, the SwiGLU's tile input gradient (3584/4) added."""
    whole = {p.op: p for p in layer_backward_walk(llama(), "mlp")}
    tiled = {p.op: p for p in layer_backward_walk(llama(mlp_tiles=4), "mlp")}
    assert whole["fc2"].saved_bytes == (3336 + 5888) * MIB
    assert tiled["fc2"].saved_bytes == (3336 + 1472) * MIB
    assert tiled["fc2"].grad_bytes == (512 + 512 + 448) * MIB
    assert tiled["act"].saved_bytes == (3336 + 1472 - 448) * MIB
    assert tiled["act"].grad_bytes == (512 + 512 + 448 + 896) * MIB
    assert tiled["act"].live_bytes == 6728 * MIB  # against 13,320 MiB untiled
    assert whole["act"].live_bytes == 13320 * MIB
    # the other ops and the tape are the `mlp` group's
    for op in ("norm2", "out_proj", "attention_core", "qkv_proj", "norm1"):
        assert tiled[op] == whole[op]
    tape = selective_activation_bytes_per_layer(llama(mlp_tiles=4), "mlp")
    assert tape == selective_activation_bytes_per_layer(llama(), "mlp")


def test_uneven_tiles_take_the_largest_chunk():
    """torch.chunk of 65,536 tokens in 3: 21,846 + 21,846 + 21,844; a tile holds the first."""
    three = {p.op: p for p in layer_backward_walk(llama(mlp_tiles=3), "mlp")}
    per_token = (4096 + 2 * 14336 + 14336) * 2  # fc1's input, fc1's output, fc2's input
    assert three["fc2"].saved_bytes == 3336 * MIB + 21846 * per_token


def test_tiles_imply_the_mlp_word():
    """TiledMLP replaces every MLP's forward: every stored layer recomputes its MLP."""
    spec = llama(mlp_tiles=4)
    assert parse_strategy("none", spec).name == "mlp"
    assert parse_strategy("selective+uniform:2", spec).name == "selective+mlp+uniform:2"
    assert parse_strategy("full", spec).name == "mlp+uniform:1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mlp_tiles": 0}, "key 'mlp_tiles'"),
        ({"mlp_tiles": 70000}, r"must be at most the tokens of a micro-batch per rank \(65536\)"),
    ],
)
def test_refusals(changes, message):
    with pytest.raises(SpecError, match=message):
        llama(**changes)
    with pytest.raises(SpecError, match="tiles a dense MLP"):
        load_spec("mixtral-8x7b", {"mlp_tiles": 2})


def test_sweep_tries_tiles_on_long_sequences():
    """DeepSpeed's example tile count, ceil(seqlen / hidden); none below twice the hidden size.
    On an H100 with ZeRO-3 over 8 GPUs at 64k tokens, the tiled MLP lets the sweep's optimal
    schedule recompute less under the same budget: a shorter step (the lever the sweep applies
    to its best plan, `search.tiled_mlp_note`)."""
    assert tiled_mlp_tiles(llama()) == 16
    assert tiled_mlp_tiles(llama(seq=4096)) is None
    gpu = load_gpu("h100-sxm")
    spec = llama(loss="chunked:16", dp=8, zero=3)
    result = sweep(spec, gpu.memory_bytes, gpu=gpu)
    optimal = next(c for c in result.candidates if c.plan.strategy == "optimal")
    note = tiled_mlp_note(optimal, result.usable_bytes, gpu)
    assert "--set mlp_tiles=16" in note and "mlp+optimal" in note
    assert "fits; optimal without it" in note and "s instead of " in note


def test_sweep_tries_the_step_in_backward():
    """The optimizer stepping in backward holds one layer's gradients: a plan one byte over
    its budget fits with it, and the sweep's note says so; not where it cannot run."""
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.search import Candidate, in_backward_note

    spec = load_spec("gpt2", {"framework": "deepspeed"})
    plan = evaluate(spec, parse_strategy("uniform:2", spec))
    usable = plan.budgeted_bytes - 1
    note = in_backward_note(Candidate(plan, usable), usable, None)
    assert note.startswith("Optimizer in backward (--set optimizer_in_backward=true): uniform:2")
    assert "(fits; uniform:2 without it:" in note
    accumulating = load_spec("gpt2", {"framework": "deepspeed", "microbatches": 2})
    plan = evaluate(accumulating, parse_strategy("uniform:2", accumulating))
    assert in_backward_note(Candidate(plan, usable), usable, None) is None
