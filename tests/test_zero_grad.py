"""`zero_grad: zeros` (ckplan.model.memory `gradients_kept_between_steps`): the gradients kept
allocated and zeroed between steps, as PyTorch's zero_grad did by default before 2.0, are alive
all step. By hand on the small Llama of test_optimizers (h 64, a 4, g 2, F 128, V 256, two
layers, untied, fp32 gradients: 106,816 parameters), and against torch.optim on CPU (skipped
without torch, failed under CKPLAN_REQUIRE_TORCH=1)."""

import pytest
from test_optimizers import P, small

from ckplan.model.memory import (
    chain_gradient_bytes,
    gradient_lifetime,
    model_state_bytes,
    trainable_tensors,
)
from ckplan.model.spec import SpecError
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import parse_strategy

# each layer 36,992 parameters, the embedding 256 x 64, the output layer 256 x 64 and the final
# norm 64: 16,384 + 2 x 36,992 + 16,448 = 106,816, 4 bytes each
EMBEDDING, LAYER, OUTPUT = 4 * 16_384, 4 * 36_992, 4 * 16_448
ALL_GRADIENTS = 4 * P  # 427,264
# LoRA on q_proj and v_proj at r 16, per layer: A (16, 64), B (64, 16); A (16, 64), B (32, 16)
ADAPTER_GRADIENTS = 4 * 2 * (16 * 64 + 64 * 16 + 16 * 64 + 32 * 16)  # 28,672


def plan_of(**changes):
    spec = small(**changes)
    return evaluate(spec, parse_strategy("none", spec))


def test_the_chain_writes_every_gradient():
    assert chain_gradient_bytes(small()) == (EMBEDDING, LAYER, LAYER, OUTPUT)
    assert EMBEDDING + 2 * LAYER + OUTPUT == ALL_GRADIENTS == 427_264


def test_zeros_holds_every_gradient_at_the_peak():
    """set_to_none: the gradients written by the step's fullest point, the output layer's and
    more (the peak of activations + gradients comes during the layers' backward), fewer than
    all; zeros: all 427,264 bytes, and the step's total grows by the difference alone."""
    freed, kept = plan_of(), plan_of(zero_grad="zeros")
    assert OUTPUT < freed.model_states.gradients < ALL_GRADIENTS
    assert kept.model_states.gradients == ALL_GRADIENTS
    assert kept.activation_bytes == freed.activation_bytes
    assert kept.total_bytes - freed.total_bytes == ALL_GRADIENTS - freed.model_states.gradients


def test_zeros_counts_the_trained_parameters_only():
    """LoRA: the adapters' gradients alone, all of them (none are written by the peak of
    the set_to_none step)."""
    assert plan_of(training="lora").model_states.gradients == 0
    assert plan_of(training="lora", zero_grad="zeros").model_states.gradients == ADAPTER_GRADIENTS


def test_zeros_is_sharded_as_the_layout_shards_gradients():
    """FSDP (torchtitan, zero 2 over dp 2): each GPU keeps its half of the gradients."""
    fsdp = {"framework": "torchtitan", "dp": 2, "zero": 2}
    assert plan_of(**fsdp, zero_grad="zeros").model_states.gradients == ALL_GRADIENTS // 2
    assert plan_of(**fsdp).model_states.gradients < ALL_GRADIENTS // 2


def test_persistent_buffers_do_not_change():
    """Megatron-LM's main-gradient buffer is held all step whichever value."""
    megatron = plan_of(framework="megatron")
    assert megatron.model_states.gradients == ALL_GRADIENTS
    assert plan_of(framework="megatron", zero_grad="zeros").total_bytes == megatron.total_bytes


def test_lifetime_reported():
    assert gradient_lifetime(small()) == "backward"
    assert gradient_lifetime(small(zero_grad="zeros")) == "step"
    assert gradient_lifetime(small(optimizer_in_backward=True)) == "one_layer"
    assert gradient_lifetime(small(microbatches=2)) == "step"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"zero_grad": "zero"}, "key 'zero_grad' must be one of none, zeros, got 'zero'"),
        ({"zero_grad": True}, "key 'zero_grad' expects a string"),
        (
            {"zero_grad": "zeros", "optimizer_in_backward": True},
            "key 'zero_grad' (zeros) conflicts with optimizer_in_backward",
        ),
    ],
)
def test_refused(changes, message):
    with pytest.raises(SpecError) as raised:
        small(**changes)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def _gradient_bytes(parameters) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in parameters if p.grad is not None)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_torch_zero_grad_keeps_the_gradients(optimizer, set_to_none):
    """torch.optim over tensors of ckplan's trainable shapes, two steps, each ending with
    zero_grad(set_to_none=...): in the second step's forward and at the start of its backward
    the gradients alive are all of ckplan's `zero_grad: zeros` gradients, or none."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    spec = small(zero_grad="none" if set_to_none else "zeros")
    parameters = [
        torch.nn.Parameter(torch.randn(shape))
        for shape, count in trainable_tensors(spec, 0).items()
        for _ in range(count)
    ]
    make = {
        "sgd": lambda: torch.optim.SGD(parameters, lr=0.1),
        "adamw": lambda: torch.optim.AdamW(parameters),
    }
    step = make[optimizer]()
    seen: dict[str, int] = {}

    def loss():
        seen["forward"] = _gradient_bytes(parameters)
        value = sum(p.square().sum() for p in parameters)
        value.register_hook(lambda grad: seen.__setitem__("backward", _gradient_bytes(parameters)))
        return value

    for _ in range(2):
        loss().backward()
        step.step()
        step.zero_grad(set_to_none=set_to_none)
    held = 0 if set_to_none else model_state_bytes(spec).gradients
    assert held == (0 if set_to_none else ALL_GRADIENTS)
    assert seen == {"forward": held, "backward": held}
    if not set_to_none:
        assert all(p.grad is not None and not p.grad.any() for p in parameters)


def test_advice_sets_the_gradients_to_none():
    """GPT-2 under the Trainer, over the budget by one byte with its gradients kept zeroed:
    setting them to None is advised, and the step in backward comes with it (its hooks free
    each gradient); with them set to None already, neither key is touched."""
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.advice import advise, least_bytes

    freed_spec = load_spec("gpt2", {"framework": "hf"})
    spec = freed_spec.replace(zero_grad="zeros")
    found = advise(spec, least_bytes(spec) - 1)
    freed = [a for a in found if a.keys == {"zero_grad": "none"}]
    assert freed and freed[0].fits
    assert freed[0].total_bytes == least_bytes(freed_spec) < least_bytes(spec)
    for a in found:
        if a.keys.get("optimizer_in_backward"):
            assert a.keys.get("zero_grad") == "none"
    unchanged = advise(freed_spec, least_bytes(freed_spec) - 1)
    assert not any("zero_grad" in a.keys for a in unchanged)


def test_sweep_notes_the_gradients_set_to_none(capsys):
    """A sweep that does not fit with the gradients kept zeroed names the two levers that free
    them: zero_grad none, and the step in backward with it."""
    import json

    from ckplan.cli import main

    argv = ["sweep", "gpt2", "--budget", "6.8GB", "--json"]
    argv += ["--set", "framework=hf", "--set", "zero_grad=zeros", "--set", "micro_batch=4"]
    assert main(argv) in (0, 1)
    notes = [note for note in json.loads(capsys.readouterr().out)["notes"] if "zero_grad" in note]
    assert notes[0].startswith("Gradients set to None (--set zero_grad=none):")
    assert notes[1].startswith(
        "Optimizer in backward (--set optimizer_in_backward=true --set zero_grad=none):"
    )
