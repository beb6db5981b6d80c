#!/usr/bin/env python3
"""The device memory of a bitsandbytes 4-bit model while DeepSpeed ZeRO-3 starts, replayed
through PyTorch's caching allocator (validation/caching_allocator.py): PEFT's documented QLoRA
run of Llama-2-70B on two GPUs (validation/runs/memory-peft-docs-llama2-70b-deepspeed-fsdp.yaml,
peft-docs-llama2-70b-qlora-zero3-2gpu), before its first training step.

The code path, at the releases that run used:

1. transformers v4.39.0 builds a quantised model without `deepspeed.zero.Init`
   (src/transformers/modeling_utils.py `from_pretrained`: `if is_deepspeed_zero3_enabled() and
   not is_quantized`), with the bitsandbytes quantiser's device_map {"": current device}
   (quantizers/quantizer_bnb_4bit.py `update_device_map`): the embedding, norms and lm_head
   load onto the GPU whole; each linear weight is quantised on the GPU (bitsandbytes 0.43.0
   nn/modules.py `Params4bit._quantize`: the bf16 weight, quantize_4bit's fp32 absmax, the
   packed output, then the double-quantised uint8 absmax and its fp32 second level) and then,
   "for quantized modules with FSDP/DeepSpeed Stage 3", its data moved to the CPU
   (`_load_state_dict_into_meta_model`: `type(value)(value.data.to("cpu"), **value.__dict__)`):
   the quant state stays on the GPU.
2. DeepSpeed v0.14.0's engine, finding no ZeRO-3 parameter (`is_zero_init_model` False), calls
   `self.module.to(self.device)` (deepspeed/runtime/engine.py `_configure_distributed_model`):
   every packed weight and LoRA adapter comes to the GPU, module order.
3. The ZeRO-3 optimizer converts the parameters (deepspeed/runtime/zero/parameter_offload.py
   `_convert_to_zero_parameters` -> partition_parameters.py `Init`, `_zero_init_param`):
   per parameter, in `module.parameters()` order, a partition of ⌈numel/dp⌉ elements is
   allocated, the shard copied, then the whole freed (`_partition_param`, `free_param`).
4. `_create_fp16_partitions_with_defragmentation` (stage3.py) calls `defragment`, whose
   `get_accelerator().empty_cache()` releases every wholly free segment.

Outside the allocator during that peak: the CUDA context and the WORLD communicator, which the
conversion's `dist.broadcast` of each parameter uses (`_zero_init_param`); DeepSpeed's clone of
WORLD for the gradients comes later. The checkpoint's key order and the loading's other
transients are approximated (each shard's keys sorted, one layer's keys at a time).

    python validation/deepspeed_zero3_qlora_init_replay.py   # JSON on stdout

Result (ckplan at this commit): the whole 4-bit model on each GPU, 36.57e9 bytes allocated,
36.97e9 reserved at the peak, 37.69e9 as nvidia-smi counts it (+3.0 % on the published 36.6e9);
after the conversion and empty_cache 19.51e9 reserved for 18.85e9 allocated, so little of it
stays into training. ckplan's training-step prediction for the run, 32.52e9 (-11.1 %), is
below that start-up peak. Which of the two the documentation's figure is cannot be read from
the code: a monitor that kept the maximum from the start would show the start-up figure, one
that starts with the training loop (transformers' WandbCallback.on_train_begin, after
accelerate's prepare) would not, so ckplan's prediction stays the training step's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from caching_allocator import CachingAllocator

from ckplan.hardware.device_memory import nccl_communicator_bytes
from ckplan.inputs.gpus import load_gpu
from ckplan.model.finetune import NF4_BLOCK, NF4_STATS_BLOCK, linear_shapes
from ckplan.published.predict import predict
from ckplan.published.suite import suite_runs

RUN = "peft-docs-llama2-70b-qlora-zero3-2gpu"
HALF = 2
# transformers' LlamaDecoderLayer registers self_attn (q, k, v, o), then mlp (gate, up, down)
MODULE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Device:
    """Named allocations on one CachingAllocator."""

    def __init__(self) -> None:
        self.cache = CachingAllocator()
        self.live: dict[object, object] = {}

    def alloc(self, key: object, size: int) -> None:
        self.live[key] = self.cache.malloc(size)

    def free(self, key: object) -> None:
        self.cache.free(self.live.pop(key))


def quant_state_sizes(values: int) -> tuple[int, int, int, int]:
    """bitsandbytes 0.43.0 functional.py quantize_4bit with compress_statistics: the uint8
    absmax (one per block of 64), the second level's fp32 absmax (one per 256 blocks), the 16
    fp32 code values (`get_4bit_type`) and the fp32 offset."""
    blocks = -(-values // NF4_BLOCK)
    return blocks, 4 * -(-blocks // NF4_STATS_BLOCK), 16 * 4, 4


def replay(spec) -> dict[str, int]:
    shapes = linear_shapes(spec)
    rank, dp, layers = spec.lora_rank, spec.dp, spec.layers
    vocab_bytes = spec.vocab * spec.hidden * HALF
    norm_bytes = spec.hidden * HALF
    device = Device()
    # 1. loading: per checkpoint key, in each shard's sorted order (layer by layer)
    device.alloc("embed", vocab_bytes)
    for layer in range(layers):
        for name in sorted((*MODULE_ORDER, "input_layernorm", "post_attention_layernorm")):
            if name.endswith("layernorm"):
                device.alloc((name, layer), norm_bytes)
                continue
            fan_in, fan_out = shapes[name]
            values = fan_in * fan_out
            device.alloc("bf16 weight", HALF * values)
            device.alloc("fp32 absmax", 4 * -(-values // NF4_BLOCK))
            device.alloc("packed", values // 2)
            for i, size in enumerate(quant_state_sizes(values)):
                device.alloc(("quant state", layer, name, i), size)
            for transient in ("fp32 absmax", "bf16 weight", "packed"):  # packed data to the CPU
                device.free(transient)
    device.alloc("norm", norm_bytes)
    device.alloc("lm_head", vocab_bytes)
    loaded = device.cache.reserved
    # 2. the engine's module.to(device): packed weights and adapters, module order
    for layer in range(layers):
        for name in MODULE_ORDER:
            fan_in, fan_out = shapes[name]
            device.alloc(("weight", layer, name), fan_in * fan_out // 2)
            device.alloc(("lora_A", layer, name), HALF * rank * fan_in)
            device.alloc(("lora_B", layer, name), HALF * fan_out * rank)
    whole_model = device.cache.allocated

    # 3. ZeRO-3's conversion: partition allocated, whole freed, `module.parameters()` order
    def partition(key: object, size: int) -> None:
        device.alloc(("partition", key), -(-size // (HALF * dp)) * HALF)
        device.free(key)

    partition("embed", vocab_bytes)
    for layer in range(layers):
        for name in MODULE_ORDER:
            fan_in, fan_out = shapes[name]
            partition(("weight", layer, name), fan_in * fan_out // 2)
            partition(("lora_A", layer, name), HALF * rank * fan_in)
            partition(("lora_B", layer, name), HALF * fan_out * rank)
        partition(("input_layernorm", layer), norm_bytes)
        partition(("post_attention_layernorm", layer), norm_bytes)
    partition("norm", norm_bytes)
    partition("lm_head", vocab_bytes)
    # 4. defragment's empty_cache
    device.cache.empty_cache()
    return {
        "reserved_after_loading": loaded,
        "allocated_whole_model": whole_model,
        "peak_reserved": device.cache.peak_reserved,
        "allocated_after_conversion": device.cache.allocated,
        "reserved_after_empty_cache": device.cache.reserved,
    }


def main() -> None:
    run = next(run for run in suite_runs() if run.name == RUN)
    prediction = predict(run)
    gpu = load_gpu(run.gpu, run.gpu_settings)
    result = replay(prediction.spec)
    outside = gpu.cuda_context_bytes + nccl_communicator_bytes(prediction.spec.dp, gpu)
    result["start_up_nvidia_smi_bytes"] = result["peak_reserved"] + outside
    result["training_step_prediction"] = int(prediction.predicted)
    result["published"] = int(run.published.value)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
