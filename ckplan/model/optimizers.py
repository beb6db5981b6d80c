"""Optimizers: the state each keeps per trainable parameter, and what its step moves.

The `optimizer` key picks the optimizer; `optimizer_bytes` defaults to the part of its state
that is a whole number of bytes per parameter (`per_parameter_bytes`), and the part that depends
on the tensors' shapes (8-bit block statistics, Adafactor's factored moments) is added exactly
per tensor (`tensor_state_bytes`) while optimizer_bytes is at that default. An explicit
optimizer_bytes wins: then the state is optimizer_bytes per trainable parameter. The fp32
master copy (master_bytes) is the framework's mixed-precision recipe, not the optimizer's.

- `adamw`: torch.optim.AdamW, exp_avg and exp_avg_sq in the parameters' dtype, fp32 beside
  fp32 master weights: the framework's bytes (8; torch/optim/adamw.py, PyTorch v2.13.0).
- `adamw-bf16`: both moments in bf16, 2 + 2 bytes (torchao's AdamW with bf16 states; the
  moments as the bf16 parameters keep them in torch.optim.AdamW).
- `adamw-8bit`, `paged-adamw-8bit`: bitsandbytes' block-wise 8-bit Adam (Dettmers et al. 2022,
  "8-bit Optimizers via Block-wise Quantization"): `tensor_8bit_state_bytes`. The paged variant
  allocates the same states in CUDA unified memory, which the driver pages to the host only
  under memory pressure: ckplan counts them on the device, as when nothing is paged out.
- `adafactor`: factored second moment, no first moment (Shazeer & Stern 2018, Algorithm 4, β1
  = 0; transformers' Adafactor defaults, beta1=None): `tensor_adafactor_state_bytes`.
- `sgd`: torch.optim.SGD with momentum, one momentum buffer (4 bytes in fp32);
  `sgd-nomomentum`: no state.
- `lion`: one momentum buffer (Chen et al. 2023, "Symbolic Discovery of Optimization
  Algorithms", Program 1: only the momentum is tracked), 4 bytes in fp32.

`optimizer_in_backward`: each parameter steps as soon as its gradient is accumulated and the
gradient is freed (PyTorch's torch/distributed/optim/apply_optimizer_in_backward.py
`_apply_optimizer_in_backward`, and torchtune's `optimizer_in_bwd`, recipes/
full_finetune_single_device.py at v0.6.1): no full gradient buffer is held
(`in_backward_gradient_parameters`).
"""

from __future__ import annotations

from collections.abc import Mapping

OPTIMIZERS = (
    "adamw",
    "adamw-bf16",
    "adamw-8bit",
    "paged-adamw-8bit",
    "adafactor",
    "sgd",
    "sgd-nomomentum",
    "lion",
)
EIGHT_BIT = ("adamw-8bit", "paged-adamw-8bit")
SHAPED = (*EIGHT_BIT, "adafactor")  # states that depend on each tensor's shape
# bitsandbytes 0.45.5, bitsandbytes/optim/optimizer.py Optimizer2State.init_state: block-wise
# states of 256 values, each block with an fp32 absmax per state; tensors of fewer than
# min_8bit_size (4096, bitsandbytes/optim/adamw.py AdamW8bit) values keep fp32 states.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
# bitsandbytes 0.45.5, optim/optimizer.py `get_state_buffer`: a paged optimizer allocates a
# state of 1e5 values or more with functional.get_paged (csrc/pythonInterface.cpp
# `cget_managed_ptr`: cudaMallocManaged), outside PyTorch's caching allocator; smaller states
# with torch.zeros_like
BNB_MIN_PAGED_SIZE = 100_000
FP32 = 4

Shape = tuple[int, ...]


def per_parameter_bytes(optimizer: str, framework_bytes: int) -> int:
    """The optimizer state's bytes per trainable parameter that do not depend on the tensors'
    shapes (module docstring): adamw the framework's (`framework_bytes`), adamw-bf16 2 + 2,
    8-bit Adam one uint8 per moment, 1 + 1, Adafactor none (all per tensor), SGD with momentum
    and Lion one fp32 buffer, SGD without momentum none."""
    return {
        "adamw": framework_bytes,
        "adamw-bf16": 4,
        "adamw-8bit": 2,
        "paged-adamw-8bit": 2,
        "adafactor": 0,
        "sgd": FP32,
        "sgd-nomomentum": 0,
        "lion": FP32,
    }[optimizer]


def tensor_8bit_state_bytes(numel: int) -> int:
    """Beyond 2 bytes per value, bitsandbytes' 8-bit Adam's state for one tensor of `numel`
    values (bitsandbytes 0.45.5, optim/optimizer.py Optimizer2State.init_state): with at least
    min_8bit_size values, state1 and state2 in uint8 (the 2 bytes) and per 256-value block one
    fp32 absmax for each, absmax1 and absmax2: 2·4·⌈n/256⌉; below it, state1 and state2 in fp32,
    8 bytes per value, 6 beyond the 2. The quantisation maps (qmap1, qmap2) are one tensor per
    device shared by every parameter (not counted)."""
    if numel < BNB_MIN_8BIT_SIZE:
        return (2 * FP32 - 2) * numel
    return 2 * FP32 * -(-numel // BNB_BLOCK)


def paged_state_bytes(optimizer: str, tensors: Mapping[Shape, int]) -> int:
    """The optimizer state of `tensors` (shape -> how many) that a paged bitsandbytes optimizer
    holds in CUDA unified memory, outside PyTorch's caching allocator (`BNB_MIN_PAGED_SIZE`):
    state1 and state2 of every tensor of at least 1e5 values, one uint8 each per value with
    8-bit Adam (`paged-adamw-8bit`); their fp32 absmax blocks stay in the allocator. 0 for the
    other optimizers. The bytes torch.cuda.memory_stats does not count."""
    if optimizer != "paged-adamw-8bit":
        return 0
    return sum(
        count * 2 * _numel(shape)
        for shape, count in tensors.items()
        if _numel(shape) >= BNB_MIN_PAGED_SIZE  # 8-bit, as 1e5 > min_8bit_size
    )


def tensor_adafactor_state_bytes(shape: Shape) -> int:
    """Adafactor's state for one tensor (transformers v4.56.0, src/transformers/optimization.py
    Adafactor.step; Shazeer & Stern 2018 §3): a tensor of two or more dimensions keeps the
    second moment factored, exp_avg_sq_row of shape[:-1] and exp_avg_sq_col of shape[:-2] +
    shape[-1:]; a vector keeps exp_avg_sq whole. In the gradient's dtype after `grad.float()`:
    fp32. No exp_avg with beta1=None (the default). After the first step `state["RMS"]` holds
    the parameter's root mean square, a 0-dim fp32 tensor: 4 bytes more per tensor."""
    if len(shape) >= 2:
        lead = 1
        for size in shape[:-2]:
            lead *= size
        return FP32 * lead * (shape[-2] + shape[-1]) + FP32
    return FP32 * shape[0] + FP32


def tensor_state_bytes(optimizer: str, tensors: Mapping[Shape, int]) -> int:
    """The shape-dependent part of the optimizer state of `tensors` (shape -> how many), exact:
    `tensor_8bit_state_bytes` or `tensor_adafactor_state_bytes` per tensor; 0 for the others."""
    if optimizer in EIGHT_BIT:
        return sum(
            count * tensor_8bit_state_bytes(_numel(shape)) for shape, count in tensors.items()
        )
    if optimizer == "adafactor":
        return sum(count * tensor_adafactor_state_bytes(shape) for shape, count in tensors.items())
    return 0


def step_bytes_per_parameter(
    optimizer: str, grad_bytes: int, master_bytes: int, weight_bytes: int, state_bytes: int
) -> int:
    """Bytes one optimizer step reads and writes per trainable parameter, memory-bound (derived
    from each update rule, as Megatron-LM's mixed-precision Adam): it reads the gradient, reads
    and writes the master weight and every state byte, and writes the working weight; without
    a master copy the weight is what it steps, read and written (torch.optim.AdamW's fused
    kernel, `_fused_adamw_`, updates param, exp_avg and exp_avg_sq in place). `state_bytes` is
    the per-parameter state (optimizer_bytes: 8-bit Adam's block statistics and Adafactor's
    factored moments are small beside it). Adafactor reads the gradient twice (the squared
    gradient's row and column means, then the update; transformers' Adafactor.step)."""
    grads = 2 * grad_bytes if optimizer == "adafactor" else grad_bytes
    weights = weight_bytes if master_bytes else 2 * weight_bytes
    return grads + 2 * master_bytes + 2 * state_bytes + weights


def adam_moment_bytes(optimizer_bytes: int) -> int:
    """Bytes of one Adam moment per parameter: exp_avg and exp_avg_sq share the state, each
    in the stepped parameters' dtype (torch/optim/adam.py `_init_group`, PyTorch v2.13.0:
    `torch.zeros_like(p, memory_format=torch.preserve_format)`)."""
    return optimizer_bytes // 2


def foreach_adamw_workspace_bytes(parameters: int, optimizer_bytes: int) -> int:
    """What torch.optim.AdamW's foreach step allocates beside the states: `exp_avg_sq_sqrt =
    torch._foreach_sqrt(device_exp_avg_sqs)`, a copy of every exp_avg_sq of the (device,
    dtype) group at once, alive until the parameters are updated (torch/optim/adam.py
    `_multi_tensor_adam`, PyTorch v2.13.0; the fused kernel, `_fused_adam`, updates in
    place and allocates none)."""
    return parameters * adam_moment_bytes(optimizer_bytes)


def adafactor_workspace_bytes(largest: int, weight_bytes: int, grad_bytes: int) -> int:
    """What transformers' Adafactor step allocates at most beside the states: it steps tensor by
    tensor, and for one of `largest` values holds two fp32 temporaries at once (`grad**2` and
    `+ eps`; then that sum and `_approx_sq_grad`'s outer product, or `exp_avg_sq.rsqrt()`; then
    the update and `-update` in `p_data_fp32.add_(-update)`), beside an fp32 copy of a half
    gradient (`grad.float()`) and of a half parameter (`p_data_fp32 = p.float()`), alive
    through the tensor's step (src/transformers/optimization.py `Adafactor.step`,
    transformers v5.25.0)."""
    copies = (grad_bytes < FP32) + (weight_bytes < FP32)
    return largest * FP32 * (2 + copies)


def foreach_adamw_step_bytes_per_parameter(
    grad_bytes: int, master_bytes: int, weight_bytes: int, optimizer_bytes: int
) -> int:
    """Bytes torch.optim.AdamW's foreach step reads and writes per parameter, one memory-bound
    kernel per operation of `_multi_tensor_adam` (torch/optim/adam.py, PyTorch v2.13.0), over
    the stepped parameter (p bytes: the master copy where there is one, else the weight), its
    gradient (g) and its two moments (e each):

    - `_foreach_mul_(params, 1 - lr·weight_decay)`, decoupled weight decay: 2p (skipped at
      weight_decay 0, the Trainer's default; counted, as torch.optim.AdamW's 0.01);
    - `_foreach_lerp_(exp_avgs, grads, 1 - β1)`: 2e + g;
    - `_foreach_mul_(exp_avg_sqs, β2)`: 2e;
    - `_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - β2)`: 2e + g;
    - `exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)`, then `_foreach_div_` by
      sqrt(1 - β2^t) and `_foreach_add_` of eps on it: 3 x 2e;
    - `_foreach_addcdiv_(params, exp_avgs, exp_avg_sq_sqrt, step_size)`: 2p + 2e;

    4p + 14e + 2g in all (80 bytes at fp32, where the fused kernel moves 28), and the working
    weight's write where a master copy is stepped (`step_bytes_per_parameter`)."""
    e = adam_moment_bytes(optimizer_bytes)
    p = master_bytes or weight_bytes
    kernels = (2 * p, 2 * e + grad_bytes, 2 * e, 2 * e + grad_bytes, 3 * 2 * e, 2 * p + 2 * e)
    return sum(kernels) + (weight_bytes if master_bytes else 0)


def _numel(shape: Shape) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel
