"""The model: what a layer saves and computes, pure functions over a model description.

No I/O and no printing: files are read by `ckplan.inputs`, results shown by `ckplan.render`.

    parts          the frozen records a description is made of (architecture, run shape,
                   parallelism, data parallelism, training state,
                   fine-tuning) and the size ranges
    spec           ModelSpec (the parts, validated together), ChainSpec (what one GPU's chain
                   depends on), spec_from_mapping (the one gate every input passes)
    kernel_profile a kernel profile as a value (Profile, FUSED)
    frameworks     what each training framework keeps per parameter, its buffers, its layouts
    loss           the output stage and the loss, as each implementation holds it
    allocator      the caching allocator's reserved peak beside the allocated one
    layers         layer sets and kinds of layers (dense, MoE, sliding window), pipeline stages
    op             one op's record (Op, Matmul) and the per-rank shapes (LayerShapes)
    mlp_block      the MLP block's ops (dense MLPs and shared experts)
    mla            multi-head latent attention's projections
    moe            the mixture-of-experts block
    finetune       frozen weights, LoRA and QLoRA: the op post-pass and the adapters' sizes
    ops            the op table of a layer, with its kernel profile applied
    profiles       kernel profiles: parsed from a mapping, applied to an op table
    memory         activation bytes per op and layer, parameters, model states
    flops          forward, backward and per-iteration FLOPs
    expert_layout  the experts one GPU holds
"""

__all__ = [
    "allocator",
    "expert_layout",
    "finetune",
    "flops",
    "frameworks",
    "kernel_profile",
    "layers",
    "loss",
    "memory",
    "mla",
    "mlp_block",
    "moe",
    "op",
    "ops",
    "parts",
    "profiles",
    "spec",
]
