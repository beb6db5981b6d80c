"""What PyTorch FSDP (FSDP1, FullyShardedDataParallel) holds beside the activations in a
Hugging Face Trainer-like training step, measured on the CPU: the check behind ckplan's FSDP1
buffers (`frameworks.fsdp1_kept_unsharded_bytes`, `fsdp1_layer_forward_bytes`,
`fsdp1_layer_backward_bytes`, `fsdp1_embedding_backward_bytes`).

Set-up, as the Trainer builds FSDP through accelerate (transformers v4.43.0 training_args.py,
accelerate v0.33.0 FullyShardedDataParallelPlugin): a transformers LlamaForCausalLM with a small
config (hidden 256, FFN 512, 4 heads, 2 KV heads, 4 layers, vocabulary 6000, untied), fp32
weights, `gradient_checkpointing_enable(use_reentrant=True)` (transformers v4.43.0's default),
each LlamaDecoderLayer an FSDP unit (`transformer_auto_wrap_policy`), FULL_SHARD,
MixedPrecision(param, reduce and buffer dtype bf16), backward_prefetch None (the Trainer's
"NO_PREFETCH"), forward_prefetch off, limit_all_gathers and use_orig_params on; 8 ranks of a
fake process group (torch.testing._internal.distributed.fake_pg.FakeStore: collectives do
nothing, tensors are real). The loss is transformers v4.43.0's LlamaForCausalLM one, written out
(`logits.float()`, the shifted `.contiguous()` copy, CrossEntropyLoss); then FSDP's
clip_grad_norm_, torch.optim.AdamW with foreach (the CUDA default) and zero_grad.

Every allocation and free of the second step is read from the PyTorch profiler
(`profile_memory=True`: the CPU allocator reports each block, storage resizes too, which is how
FSDP1 frees its unsharded flat parameters); the live blocks at each phase's peak are listed by
size. Phases: forward, loss, backward (marked inside by backward pre-hooks on the final norm and
on the embedding: the layers' backward and the embedding's), clip, step.

The CPU's differences from a CUDA run: no streams, so a block FSDP1 frees with record_stream is
free at once (on CUDA the allocator waits for the stream), and nothing here reads the caching
allocator's reserved bytes.

With --backward-pre FSDP prefetches the next unit in its backward (BACKWARD_PRE, the check
behind `frameworks.fsdp1_prefetched_layers`). With --lora the same step trains PEFT's LoRA
adapters over the frozen base as PEFT's FSDP-QLoRA recipe runs it (huggingface/peft
examples/sft: `fsdp_auto_wrap_policy`, use_orig_params off, the base and the adapters in
bf16), the check behind `frameworks.fsdp1_frozen_layer_backward_bytes` and the root's copy
kept beside frozen weights (bitsandbytes needs CUDA: the base is bf16, not 4-bit).

Needs torch (2.13.0 was run), transformers (5.25 was run) and, with --lora, peft (0.21.2 was
run); prints JSON with --json, writes it with --write. Results:
validation/results-fsdp1-memory-torch-2.13.0.json, validation/results-fsdp1-lora-memory-torch-
2.13.0.json, validation/results-fsdp1-backward-pre-memory-torch-2.13.0.json.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
from pathlib import Path

RESULTS = "validation/results-fsdp1-memory-torch-2.13.0.json"
LORA_RESULTS = "validation/results-fsdp1-lora-memory-torch-2.13.0.json"
PREFETCH_RESULTS = "validation/results-fsdp1-backward-pre-memory-torch-2.13.0.json"
LORA_RANK = 8
WORLD = 8
SHAPE = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "layers": 4, "vocab": 6000}
BATCH, SEQ = 4, 128
SMALLEST = 100_000  # blocks listed at a peak: the parameter- and activation-sized ones


def _marker(torch, name: str):
    def hook(*args):
        handle = torch.ops.profiler._record_function_enter_new(name, None)
        torch.ops.profiler._record_function_exit._RecordFunction(handle)

    return hook


def measure(shape: dict = SHAPE, lora: bool = False, prefetch: bool = False) -> dict:
    """The peaks of the second step; `lora`: PEFT's LoRA (r 8 on every linear of the decoder
    layers, bf16 adapters over the frozen bf16 base) wrapped as PEFT's FSDP recipe wraps it
    (`peft.utils.other.fsdp_auto_wrap_policy`: each decoder layer, and each leaf module whose
    weight trains, its own unit; use_orig_params off, as accelerate's fsdp_config_qlora.yaml in
    huggingface/peft examples/sft/configs sets it); `prefetch`: backward_prefetch BACKWARD_PRE
    (accelerate's `fsdp_backward_prefetch`) instead of the Trainer's none."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        num_hidden_layers=shape["layers"], vocab_size=shape["vocab"],
        max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    layer_cls = {LlamaDecoderLayer}
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
    inner = model
    if lora:
        import peft
        from peft.utils.other import fsdp_auto_wrap_policy

        config_lora = peft.LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules="all-linear")
        # the sharded QLoRA recipe's dtypes: a bf16 base (torch_dtype the 4-bit storage's) and
        # adapters in it (TRL skips prepare_model_for_kbit_training for sharded QLoRA)
        model = peft.get_peft_model(
            model.to(torch.bfloat16), config_lora, autocast_adapter_dtype=False
        )
        model.enable_input_require_grads()  # PEFT's step before reentrant checkpointing
        wrap = fsdp_auto_wrap_policy(model)
        inner = model.base_model.model
    bf16 = torch.bfloat16
    fsdp = FullyShardedDataParallel(
        model,
        auto_wrap_policy=wrap,
        mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None,
        limit_all_gathers=True,
        use_orig_params=not lora,
        device_id=torch.device("cpu"),
    )
    inner.model.norm.register_full_backward_pre_hook(_marker(torch, "mark:layers"))
    inner.model.embed_tokens.register_full_backward_pre_hook(_marker(torch, "mark:embedding"))
    trained = [p for p in fsdp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=True)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    vocab = config.vocab_size

    def step():
        with record_function("phase:forward"):
            logits = fsdp(input_ids=ids).logits
        with record_function("phase:loss"):  # transformers v4.43.0 LlamaForCausalLM.forward
            logits = logits.float()
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = ids[..., 1:].contiguous()
            loss = torch.nn.CrossEntropyLoss()(shift_logits.view(-1, vocab), shift_labels.view(-1))
            del logits, shift_logits
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:clip"):
            fsdp.clip_grad_norm_(1.0)
        with record_function("phase:step"):
            optimizer.step()
        fsdp.zero_grad()

    step()  # the optimizer's states exist from the second step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return _peaks(events) | {
        "shape": shape, "batch": BATCH, "seq": SEQ, "world": WORLD,
        **({"lora_rank": LORA_RANK, "trainable": sum(p.numel() for p in trained)} if lora else {}),
    }  # fmt: skip


def _peaks(events: list[dict]) -> dict:
    """The live bytes beyond the step's start at each phase's peak, and the live blocks of at
    least SMALLEST bytes then, by size (size -> count)."""
    named = [e for e in events if e.get("name", "").startswith(("phase:", "mark:"))]
    spans = {e["name"][6:]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in named if "dur" in e}
    marks = {e["name"][5:]: e["ts"] for e in named if e["name"].startswith("mark:")}
    layers, embedding = marks.get("layers"), marks.get("embedding")
    if layers is not None and embedding is not None:
        spans["layers_backward"] = (layers, embedding)
        spans["embedding_backward"] = (embedding, spans["backward"][1])
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live: dict[int, int] = {}
    total = 0
    peaks: dict[str, dict] = {}
    for event in memory:
        size, address = event["args"]["Bytes"], event["args"]["Addr"]
        total += size
        if size > 0:
            live[address] = size
        else:
            live.pop(address, None)
        for name, (start, end) in spans.items():
            if start <= event["ts"] <= end and total > peaks.get(name, {}).get("bytes", -1):
                blocks = collections.Counter(v for v in live.values() if v >= SMALLEST)
                peaks[name] = {
                    "bytes": total,
                    "blocks": {str(k): n for k, n in sorted(blocks.items(), reverse=True)},
                }
    return {"peaks": peaks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS}")
    parser.add_argument(
        "--lora", action="store_true", help=f"PEFT's LoRA over a frozen base ({LORA_RESULTS})"
    )
    parser.add_argument(
        "--backward-pre", action="store_true", help=f"BACKWARD_PRE prefetch ({PREFETCH_RESULTS})"
    )
    args = parser.parse_args(argv)
    import torch

    measured = measure(lora=args.lora, prefetch=args.backward_pre)
    results = {"torch": torch.__version__.split("+")[0], **measured}
    text = json.dumps(results, indent=1)
    if args.write:
        target = LORA_RESULTS if args.lora else PREFETCH_RESULTS if args.backward_pre else RESULTS
        Path(target).write_text(text + "\n")
    if args.json or not args.write:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
