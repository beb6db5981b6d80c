"""Optimizer states against PyTorch: the bytes each optimizer's `state` holds after one step,
against ckplan's `optimizer` bytes (ckplan.model.optimizers). torch.optim's AdamW and SGD over
tensors of ckplan's trainable shapes (skipped without torch, failed under
CKPLAN_REQUIRE_TORCH=1); transformers' Llama with its Adafactor, and PEFT's LoRA adapters, when
those are installed (optional, skipped without them)."""

import pytest
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip

from ckplan.model.memory import model_state_bytes, trainable_tensors
from ckplan.model.spec import spec_from_mapping

torch = torch_or_skip()

from test_optimizers import SMALL  # noqa: E402  (the same small Llama, framework hf)


def state_bytes(optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if torch.is_tensor(value) and key != "step"  # torch's step counter, not a state
    )


def stepped(optimizer, parameters, loss):
    loss(parameters).backward()
    optimizer.step()
    return state_bytes(optimizer)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("adamw", lambda ps: torch.optim.AdamW(ps)),
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("sgd-nomomentum", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ],
)
@pytest.mark.parametrize("training", ["full", "lora"])
def test_torch_optimizers(name, make, training):
    spec = spec_from_mapping({**SMALL, "optimizer": name, "training": training})
    parameters = [
        torch.nn.Parameter(torch.randn(shape))
        for shape, count in trainable_tensors(spec, 0).items()
        for _ in range(count)
    ]
    measured = stepped(make(parameters), parameters, lambda ps: sum(p.square().sum() for p in ps))
    assert measured == model_state_bytes(spec).optimizer


def llama():
    transformers = framework_or_skip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    return transformers, transformers.LlamaForCausalLM(config)


def causal_lm_loss(model):
    ids = torch.randint(0, 256, (2, 16))
    return lambda _: model(input_ids=ids, labels=ids).loss


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_transformers_llama_and_adafactor():
    """The Llama's tensors are ckplan's, and Adafactor's factored moments (and RMS scalars)
    are ckplan's bytes to the byte."""
    transformers, model = llama()
    spec = spec_from_mapping({**SMALL, "optimizer": "adafactor"})
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    assert shapes == sorted(
        shape for shape, count in trainable_tensors(spec, 0).items() for _ in range(count)
    )
    optimizer = transformers.optimization.Adafactor(model.parameters())
    measured = stepped(optimizer, None, causal_lm_loss(model))
    assert measured == model_state_bytes(spec).optimizer


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    ("targets", "dora"), [("q_proj,v_proj", False), ("all-linear", False), ("all-linear", True)]
)
def test_peft_lora_adapters(targets, dora):
    """PEFT's adapters (with DoRA, their magnitude vectors too) are ckplan's trainable
    tensors; SGD with momentum keeps 4 bytes each."""
    peft = framework_or_skip("peft")
    _, model = llama()
    target_modules = targets if targets == "all-linear" else targets.split(",")
    config = peft.LoraConfig(
        r=16, target_modules=target_modules, task_type="CAUSAL_LM", use_dora=dora
    )
    model = peft.get_peft_model(model, config)
    spec = spec_from_mapping(
        {**SMALL, "training": "lora", "lora_targets": targets, "optimizer": "sgd", "use_dora": dora}
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(tuple(p.shape) for p in trainable) == sorted(
        shape for shape, count in trainable_tensors(spec, 0).items() for _ in range(count)
    )
    optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    assert stepped(optimizer, None, causal_lm_loss(model)) == model_state_bytes(spec).optimizer
