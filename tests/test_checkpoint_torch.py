"""Hugging Face gradient checkpointing with `use_reentrant` True and False holds the same bytes
for backward (docs/fine-tuning.md, "The Trainer and PEFT").

torch/utils/checkpoint.py (PyTorch v2.13.0): the reentrant `CheckpointFunction` runs the layer
under no_grad and keeps its tensor inputs (`ctx.save_for_backward`) and the RNG state; the
non-reentrant variant keeps the same inputs in its recomputation's closure and the same RNG
state, and packs the layer's saved tensors into holders that are empty until the
recomputation. Measured here on the CPU with transformers' Llama (and PEFT's LoRA, with
`enable_input_require_grads`, which reentrant checkpointing needs when the embedding is frozen,
and which PEFT calls): every storage a forward op wrote that is still alive after the forward,
parameters and the logits aside. Needs torch, transformers and PEFT (the frameworks extra)."""

import gc
import warnings
import weakref

import pytest
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip

torch = torch_or_skip()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

LAYERS, HIDDEN, BATCH, SEQ = 3, 64, 2, 32


class LiveStorages(TorchDispatchMode):
    """The storage each op's outputs live in, by address (the latest: a freed storage's address
    may be reused), with a weak reference that dies with the storage."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        return out


def held_bytes(lora: bool, reentrant: bool | None) -> int:
    transformers = framework_or_skip("transformers")
    peft = framework_or_skip("peft")
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        num_hidden_layers=LAYERS,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        lora_config = peft.LoraConfig(
            r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
        model = peft.get_peft_model(model, lora_config)
    model.train()
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers v5's new name
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
    model.enable_input_require_grads()
    ids = torch.randint(0, 256, (BATCH, SEQ))
    mode = LiveStorages()
    with mode:
        logits = model(input_ids=ids).logits
    gc.collect()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    skip.add(logits.untyped_storage().data_ptr())
    held = sum(
        nbytes
        for ptr, (ref, nbytes) in mode.storages.items()
        if ref() is not None and ptr not in skip
    )
    logits.float().sum().backward()  # a working graph: the adapters (or weights) get gradients
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    return held


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reentrant_and_non_reentrant_checkpointing_hold_the_same_bytes(lora):
    reentrant = held_bytes(lora, True)
    non_reentrant = held_bytes(lora, False)
    without = held_bytes(lora, None)
    assert reentrant == non_reentrant
    # each checkpoint keeps its layer's input (the embedding output, then each layer's output)
    assert (LAYERS + 1) * 4 * BATCH * SEQ * HIDDEN <= reentrant < without
