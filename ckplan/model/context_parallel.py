"""Context parallelism as the frameworks run it: what PyTorch's ring attention keeps alive in
the attention backward beside a plain flash-attention backward under torchtitan, and what the
ring loops' own ops move beside the kernel calls, PyTorch's under torchtitan and Transformer
Engine's under Megatron-Core (`TE_CP_MOVED`, at the end).

torchtitan runs context parallelism (cp > 1) through PyTorch's experimental
`torch.distributed.tensor.experimental.context_parallel`: its SDPA calls become
`_scaled_dot_product_ring_flash_attention(_backward)` (or the efficient-attention pair), which
loop `_templated_ring_attention(_backward)` over the cp ranks with round-robin load balancing
on (`_cp_options.enable_load_balance`). The K/V exchange is `_cp_options.rotate_method`:

- torchtitan 9dec370 (2024-12-26, `framework_version` "2024.12"): the job option
  `experimental.context_parallel_rotate_method`, default "allgather" (torchtitan/
  config_manager.py), passed to `set_rotate_method` in `utils.create_context_parallel_ctx`;
- torchtitan 0.3.0: no option and no call to `set_rotate_method`
  (torchtitan/distributed/context_parallel/api.py), so PyTorch's default, ALL_GATHER
  (`_ContextParallelOptions.rotate_method`, torch/distributed/tensor/experimental/
  _context_parallel/_attention.py at v2.13.0).

So both all-gather K and V once per call (`_AllGatherRotater`): one buffer of cp x the local
K‖V, from which each step reads the chunk it needs. The backward keeps fp32 accumulators for
dQ, dK and dV (`convert_to_f32`, on by default) and passes the dK‖dV accumulator round the ring
with an all-to-all (`dkv_rotater`, ALL_TO_ALL whatever the rotate method). The loops read the
same in PyTorch's late-2024 text (with the PRE_ALL_GATHER method, typing.List) and at v2.13.0;
the CPU check is validation/torch_cp_ring_memory.py.

The K and V the kernel sees: torchtitan 9dec370's Attention repeats them to the rank's query
heads (`repeat_kv`, torchtitan/models/llama/model.py) before SDPA; torchtitan 0.3.0 passes
`enable_gqa` (torchtitan/models/common/attention.py) and so keeps them at the rank's K/V heads.
"""

from __future__ import annotations

import math
from fractions import Fraction

from ckplan.model.frameworks import TRANSFORMER_ENGINE_RELEASES, framework_version
from ckplan.model.repeat_kv import kernel_kv_heads, repeats_kv

FP32_BYTES = 4
# cp_attention: the ring (PyTorch's ring attention under torchtitan, Transformer Engine's
# point-to-point loops under Megatron-Core, its `cp_comm_type` p2p), K and V all-gathered and
# one kernel call over them (the Llama 3 paper's context parallelism, Dubey et al. 2024
# §3.3.2), all-to-alls of Q, K, V and the output that trade the sequence split for a head
# split (DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron-Core's `cp_comm_type` a2a), or both:
# the all-to-alls inside groups of `cp_a2a_size` ranks, the ring across the groups
# (Megatron-Core's a2a+p2p, "hierarchical" context parallelism; `hierarchical_sizes`)
CP_ATTENTIONS = ("ring", "allgather", "a2a", "a2a+p2p")
# what each framework's context parallelism is modelled with
FRAMEWORK_CP_ATTENTIONS = {
    "torchtitan": ("ring", "allgather"),
    "megatron": ("ring", "allgather", "a2a", "a2a+p2p"),
}
# Transformer Engine's first release with each of Megatron-Core's `cp_comm_type`s beside p2p
# (transformer_engine/pytorch/attention.py: `AttnFuncWithCPAndKVAllGather` from v1.10,
# `AttnFuncWithCPAndQKVOA2A` from v1.11, a list of two groups as `AttnFuncWithCPAndKVP2P`'s
# cp_group from v1.12; Megatron-Core asks for "Transformer-Engine ... >= 1.12.0 to support
# hierarchical cp commucation", megatron/core/extensions/transformer_engine.py)
TE_FIRST_RELEASE = {"allgather": "te1.10", "a2a": "te1.11", "a2a+p2p": "te1.12"}
# Megatron's --cp-comm-type for each cp_attention (megatron/training/arguments.py)
MEGATRON_CP_COMM_TYPES = {
    "ring": "p2p",
    "allgather": "all_gather",
    "a2a": "a2a",
    "a2a+p2p": "a2a+p2p",
}
# the first release whose a2a forward saves the kernel's output before its all-to-all (the
# `out_part` of AttnFuncWithCPAndQKVOA2A, context_parallel.py at v2.8) and whose backward
# sends dO alone; v1.11-v2.7 save the output after it, the tensor returned, and send it back
# with dO (`out, dout = flash_attn_a2a_communicate([out, dout], ...)`)
TE_A2A_SAVES_KERNEL_OUTPUT = "te2.8"
# the same change in the point-to-point class's all-to-all part under a2a+p2p
# (`AttnFuncWithCPAndKVP2P`: `out_part` saved, `dout` alone sent back, context_parallel.py at
# v2.15; v1.12-v2.14 save the returned output and send `[out, dout]`)
TE_HIERARCHICAL_SAVES_KERNEL_OUTPUT = "te2.15"
# the first release that runs MLA's attention under context parallelism (K and V flattened
# into one K‖V buffer for the ring: `AttnFuncWithCPAndKVP2P`'s `enable_mla`, context_parallel.py
# at v2.5; `te_cp_mla_release_error`)
TE_MLA_CP_FIRST_RELEASE = "te2.5"


def uses_ring_attention(
    framework: str, cp: int, attention: str, cp_attention: str | None = None
) -> bool:
    """Whether the attention core runs PyTorch's ring attention: torchtitan with cp > 1 and a
    fused SDPA kernel (torchtitan's train context allows only the flash and efficient backends
    under context parallelism, `get_train_context` in torchtitan/utils.py at 9dec370; the ring
    handles only those, `_sdpa_handler`), unless `cp_attention` says allgather."""
    ring = cp_attention in (None, "ring")
    return framework == "torchtitan" and cp > 1 and attention != "standard" and ring


def cp_attention_error(
    framework: str, cp_attention: str | None, release: str | None = None
) -> str | None:
    """Why `cp_attention` cannot be set for `framework` (one line naming the key), or None:
    torchtitan's context parallelism is modelled as the ring or all-gathered K and V,
    Megatron-Core's as Transformer Engine's ring, all-gather or all-to-alls (`release`, its
    `framework_version`: `TE_FIRST_RELEASE`); the other frameworks' not at all."""
    prefix = f"key 'cp_attention' ({cp_attention}): "
    modelled = FRAMEWORK_CP_ATTENTIONS.get(framework, ())
    first = TE_FIRST_RELEASE.get(cp_attention) if framework == "megatron" else None
    if cp_attention is None:
        reason = None
    elif not modelled:
        reason = f"{framework} runs its own context parallelism; the key is for frameworks " + (
            " and ".join(FRAMEWORK_CP_ATTENTIONS)
        )
    elif cp_attention not in modelled:
        reason = f"under framework {framework} one of {', '.join(modelled)}"
    elif first and release and not _release_at_least(release, first):
        reason = (
            f"Transformer Engine {release} has no {MEGATRON_CP_COMM_TYPES[cp_attention]} "
            f"context parallelism (from {first}); set framework_version or cp_attention ring"
        )
    else:
        reason = None
    return prefix + reason if reason else None


def te_cp_mla_error(cp_attention: str | None, mla: bool) -> str | None:
    """Why Transformer Engine cannot run MLA's attention (K and V of different head sizes)
    under `cp_attention` (one line naming the key), or None: "Context parallelism does not
    support MLA" but with p2p and a2a+p2p (`attn_forward_func_with_cp`, context_parallel.py at
    TE v2.9)."""
    if not mla or cp_attention in (None, "ring", "a2a+p2p"):
        return None
    return (
        f"key 'cp_attention' ({cp_attention}): Transformer Engine runs MLA under context "
        "parallelism on the ring (or a2a+p2p) only"
    )


def te_cp_mla_release_error(release: str | None, mla: bool) -> str | None:
    """Why Transformer Engine `release` runs no kernel for MLA's attention under context
    parallelism (one line naming the key), or None: up to v2.4 `get_attention_backend`
    disables FusedAttention "as it does not support context parallelism with MLA"
    (dot_product_attention/utils.py at v2.4), FlashAttention runs no MLA and the unfused
    attention no context parallelism; v2.5 disables it with FP8 attention only
    (`TE_MLA_CP_FIRST_RELEASE`)."""
    if not mla or release is None or _release_at_least(release, TE_MLA_CP_FIRST_RELEASE):
        return None
    return (
        f"key 'framework_version' ({release}): Transformer Engine runs MLA under context "
        f"parallelism from {TE_MLA_CP_FIRST_RELEASE}"
    )


def te_cp_window_error(
    cp_attention: str | None,
    sliding_window: int,
    release: str | None = None,
    cudnn: bool = False,
) -> str | None:
    """Why Megatron-Core cannot run sliding-window attention under context parallelism with
    `cp_attention` on Transformer Engine `release` (one line naming the key), or None
    (`attn_forward_func_with_cp` and `DotProductAttention`'s backend filter): v1.8-v1.9 pick no
    kernel for a window under context parallelism; v1.10 runs the all-gather for it whatever
    the exchange (`uses_te_allgather`); v1.11-v1.13 run a2a, or all_gather without the cuDNN
    kernel; v2.0 on a2a and all_gather ("Context parallelism does not support sliding window
    attention with cp_comm_type=p2p", v2.9). `cudnn`: the attention kernel is cuDNN's."""
    exchange = cp_attention or "ring"
    prefix = f"key 'cp_attention' ({exchange}): Transformer Engine "
    if not sliding_window or release == "te1.10":
        return None
    if release in ("te1.8", "te1.9"):
        return prefix + f"{release} runs no kernel for a sliding window under context parallelism"
    if exchange in ("ring", "a2a+p2p"):
        return (
            prefix
            + "runs sliding-window attention under context parallelism with a2a or allgather only"
        )
    if exchange == "allgather" and cudnn and release and not _release_at_least(release, "te2.0"):
        return prefix + f"{release} runs a window's all-gather without the cuDNN kernel only"
    return None


def te_sliding_window(spec) -> int:
    """The window Transformer Engine sees: `sliding_window` where some layer has it, else 0."""
    return spec.sliding_window if spec.sliding_window_layers != "none" else 0


def te_cp_error(
    spec, cp_attention: str | None, tp: int, cp: int, cp_a2a_size: int | None = None
) -> str | None:
    """Why Megatron-Core (Transformer Engine, at the spec's `framework_version`) cannot run
    `spec`'s attention with `cp_attention` at (tp, cp), one line naming the key, or None: the
    release (`cp_attention_error`), MLA (`te_cp_mla_error`), a2a+p2p's group size
    (`hierarchical_size_error`: `cp_a2a_size`, else the spec's), and at cp > 1 MLA's release
    (`te_cp_mla_release_error`), a sliding window (`te_cp_window_error`) and for the
    all-to-alls the rank's heads (`a2a_heads_error`). The one check the spec's validation and
    `plan`'s search both make."""
    release = framework_version(spec)
    reason = cp_attention_error("megatron", cp_attention, release) or te_cp_mla_error(
        cp_attention, spec.mla
    )
    a2a_size = cp_a2a_size or spec.cp_a2a_size
    if not reason and cp_attention == "a2a+p2p":
        reason = hierarchical_size_error(cp, a2a_size)
    if reason or cp < 2 or spec.kind != "transformer":
        return reason
    if reason := te_cp_mla_release_error(release, spec.mla):
        return reason
    cudnn = spec.attention_kernel == "cudnn"
    if reason := te_cp_window_error(cp_attention, te_sliding_window(spec), release, cudnn):
        return reason
    if cp_attention not in ("a2a", "a2a+p2p"):
        return None
    heads_r = spec.heads // tp
    # K/V heads per rank as ckplan.model.op.kv_heads_per_rank counts them (one replicated head
    # when tp exceeds them); MLA's every head has its own K and V
    kv_heads_r = heads_r if spec.mla else -(-spec.kv_heads // tp)
    group = cp if cp_attention == "a2a" else a2a_size
    return a2a_heads_error(group, heads_r, kv_heads_r, cp_attention)


def hierarchical_size_error(cp: int, cp_a2a_size: int | None) -> str | None:
    """Why `cp_a2a_size` cannot split `cp` ranks for a2a+p2p (one line naming the key), or
    None: Megatron-Core needs the two sizes ("--hierarchical-context-parallel-sizes must be
    set when a2a+p2p is used", their product cp: megatron/training/arguments.py at
    core_v0.19.0); Transformer Engine's `attn_forward_func_with_cp` runs a group of one as the
    ring (a2a size 1) or the all-to-all alone (a2a size cp), so ckplan asks for those names."""
    prefix = "key 'cp_a2a_size'"
    if cp_a2a_size is None:
        return f"{prefix}: cp_attention a2a+p2p needs the all-to-all groups' size"
    if cp > 1 and (cp % cp_a2a_size or cp_a2a_size in (1, cp)):
        return (
            f"{prefix} ({cp_a2a_size}) must divide cp ({cp}) and lie strictly between 1 and cp "
            "(a2a+p2p with a group of 1 or of cp is the ring or a2a: set cp_attention to it)"
        )
    return None


def node_a2a_size(spec, tp: int, cp: int, gpus_per_node: int) -> int | None:
    """The all-to-all groups' size `plan` tries for a2a+p2p at (tp, cp): where the cp group
    spans nodes (tp·cp GPUs), the largest that keeps each group inside a node (size·tp GPUs)
    and splits cp in two levels and the rank's heads (`te_cp_error`), as Transformer Engine
    describes the scheme ("First applying a2a to QKV across each CP sub-group (e.g., via
    NVLink), then exchanging KV with p2p between sub-groups (e.g., via IBLink)",
    DotProductAttention's docstring at v2.9); None where no size does, or the group is one
    node's."""
    if tp * cp <= gpus_per_node:
        return None
    for size in range(min(cp - 1, gpus_per_node // tp), 1, -1):
        if cp % size == 0 and te_cp_error(spec, "a2a+p2p", tp, cp, size) is None:
            return size
    return None


def hierarchical_sizes(spec) -> tuple[int, int]:
    """(the all-to-all groups' size, the ring's size) of `spec`'s context parallelism: Megatron's
    --hierarchical-context-parallel-sizes under a2a+p2p (groups of consecutive cp ranks,
    `create_hierarchical_groups` in megatron/core/parallel_state.py; the ring joins the ranks
    of the same place in each group, `send_dst` in `AttnFuncWithCPAndKVP2P`); (1, cp) on the
    ring, (cp, 1) under a2a."""
    if uses_hierarchical(spec):
        return spec.cp_a2a_size, spec.cp // spec.cp_a2a_size
    if uses_a2a(spec):
        return spec.cp, 1
    return 1, spec.cp


def a2a_heads_error(
    cp: int, heads_r: int, kv_heads_r: int, cp_attention: str = "a2a"
) -> str | None:
    """Why the all-to-all context parallelism cannot split this rank's heads over `cp` ranks
    (one line naming the key), or None: each all-to-all hands every rank of its group 1/cp of
    the rank's query and K/V heads (`AttnFuncWithCPAndQKVOA2A`: "The number of attention heads
    needs to be divisible by CP size!", context_parallel.py at TE v2.9; `flash_attn_a2a_
    communicate` splits the heads the same way under a2a+p2p, over its group)."""
    if heads_r % cp == 0 and kv_heads_r % cp == 0:
        return None
    group = "cp" if cp_attention == "a2a" else "cp_a2a_size"
    return (
        f"key 'cp_attention' ({cp_attention}): {group} ({cp}) must divide the query heads "
        f"({heads_r}) and K/V heads ({kv_heads_r}) on each tensor-parallel rank"
    )


def uses_a2a(spec) -> bool:
    """Whether `spec`'s attention runs Transformer Engine's all-to-all context parallelism:
    Megatron-Core, cp > 1, `cp_attention` a2a."""
    return spec.framework == "megatron" and spec.cp > 1 and spec.cp_attention == "a2a"


def uses_hierarchical(spec) -> bool:
    """Whether `spec`'s attention runs Transformer Engine's a2a+p2p context parallelism:
    Megatron-Core, cp > 1, `cp_attention` a2a+p2p (all-to-alls over `cp_a2a_size` ranks
    around a ring over cp / cp_a2a_size)."""
    return spec.framework == "megatron" and spec.cp > 1 and spec.cp_attention == "a2a+p2p"


def uses_te_allgather(spec) -> bool:
    """Whether `spec`'s attention runs Transformer Engine's all-gather context parallelism:
    Megatron-Core, cp > 1, `cp_attention` allgather, or on v1.10 a sliding window whatever the
    exchange (`te_cp_window_error`)."""
    if spec.framework != "megatron" or spec.cp < 2:
        return False
    if spec.cp_attention == "allgather":
        return True
    ring = spec.cp_attention in (None, "ring")
    return ring and framework_version(spec) == "te1.10" and bool(te_sliding_window(spec))


def ring_kv_heads(version: str | None, heads_r: int, kv_heads_r: int) -> int:
    """The K/V heads per rank the ring all-gathers: torchtitan "2024.12" repeats K and V to the
    rank's query heads before SDPA (`repeat_kv`, torchtitan/models/llama/model.py at 9dec370);
    "0.3" keeps the rank's K/V heads (`enable_gqa`, torchtitan/models/common/attention.py at
    0.3.0): `ckplan.model.repeat_kv`'s rule."""
    return kernel_kv_heads(repeats_kv("torchtitan", version), heads_r, kv_heads_r)


def ring_backward_live_at_call_bytes(
    cp: int, q_elements: int, kv_elements: int, dtype_bytes: int
) -> int:
    """What `_templated_ring_attention_backward` (torch/distributed/tensor/experimental/
    _context_parallel/_attention.py at v2.13.0; the same loop in the late-2024 text) holds when
    it calls the kernel at step 1, the most of any step, beyond its inputs (the saved Q, K, V, O,
    logsumexp and the output gradient): `q_elements` the local Q (b·a·s/cp·d at the heads the
    kernel sees), `kv_elements` one of the local K and V, `dtype_bytes` their element size,
    cp >= 2.

    - the fp32 accumulators `grad_query`, `grad_key`, `grad_value` (`torch.zeros_like(...,
      dtype=accum_dtype)`, `convert_to_f32`): 4·(q + 2kv);
    - the all-gathered K‖V (`_AllGatherRotater._aggregated_buffer`, `all_gather_single` of
      `torch.cat([key.flatten(), value.flatten()])`): cp·B·2kv;
    - step 0's kernel gradients, still bound to `grad_query_`, `grad_key_`, `grad_value_` while
      step 1's call runs: B·(q + 2kv);
    - one K‖V concatenation (`next_kv`: step 1's, or with cp = 2 step 0's, never rebound):
      B·2kv;
    - the fp32 dK‖dV concatenation sent round the ring (`next_grad_kv = torch.cat(...)`) and the
      one received (`dkv_rotater.next_buffer()`, the all-to-all output): 2·4·2kv.
    """
    accumulators = FP32_BYTES * (q_elements + 2 * kv_elements)
    gathered_kv = cp * dtype_bytes * 2 * kv_elements
    previous_step_grads = dtype_bytes * (q_elements + 2 * kv_elements)
    kv_concat = dtype_bytes * 2 * kv_elements
    grad_kv_sent_and_received = 2 * FP32_BYTES * 2 * kv_elements
    return accumulators + gathered_kv + previous_step_grads + kv_concat + grad_kv_sent_and_received


def ring_backward_workspace_bytes(
    cp: int, q_elements: int, kv_elements: int, dtype_bytes: int
) -> int:
    """The ring's transient beyond a plain flash backward's, which ckplan counts as the core's
    input gradients B·(q + 2kv) and the kernel's own workspace (its fp32 dQ accumulator and
    softmax_d). At step 1 a rank of cp rank >= 1 runs the kernel on all its queries and the first
    half of the received keys (`key.chunk(2, dim=seq_dim)[0]`, the `i <= rank` branch): the
    kernel's dK and dV cover half the keys, B·kv less than the plain backward's, its dQ
    accumulator the whole of Q as at cp = 1. So the layer's attention backward holds
    `ring_backward_live_at_call_bytes` - B·kv more than without context parallelism.

    The other steps hold no more: the `i > rank` branch runs half the queries (B·q/2 fewer
    gradients, half the dQ accumulator). Outside the calls the largest set, with cp >= 3, is at
    step 1's K‖V concatenation: step 0's contiguous K and V copies (still bound to `k`, `v`) and
    step 0's concatenation (still bound to `next_kv`) beside the call's live set, B·4kv, where
    the call adds B·(q + kv) gradients and the 4·q dQ accumulator: no more when Q has at least
    the K/V heads, equal when the heads match (validation/torch_cp_ring_memory.py)."""
    live = ring_backward_live_at_call_bytes(cp, q_elements, kv_elements, dtype_bytes)
    return live - dtype_bytes * kv_elements


def torchtitan_ring_workspace_bytes(spec, tokens: int, heads_r: int, kv_heads_r: int) -> int:
    """The attention backward's ring transient of `spec` (0 where it does not run PyTorch's
    ring attention, `uses_ring_attention`): `tokens` the rank's b·s/cp, `heads_r` and
    `kv_heads_r` its query and K/V heads, head_dim for Q, K and V."""
    values = ring_values(spec, tokens, heads_r, kv_heads_r)
    if values is None:
        return 0
    return ring_backward_workspace_bytes(spec.cp, *values, spec.dtype_bytes)


def ring_values(spec, tokens: int, heads_r: int, kv_heads_r: int) -> tuple[int, int] | None:
    """(the rank's Q values, its values of one of K and V at the heads the ring gathers,
    `ring_kv_heads`) where `spec` runs PyTorch's ring attention (`uses_ring_attention`; MLA's
    attention is not torchtitan's), else None. `tokens`: the rank's b·s/cp."""
    if spec.mla or not uses_ring_attention(
        spec.framework, spec.cp, spec.attention, spec.cp_attention
    ):
        return None
    kv_heads = ring_kv_heads(framework_version(spec), heads_r, kv_heads_r)
    return tokens * heads_r * spec.head_dim, tokens * kv_heads * spec.head_dim


def _rank_tokens(spec) -> int:
    """The tokens one context-parallel rank attends for: b·s/cp."""
    return spec.micro_batch * (spec.seq // spec.cp)


def ring_moved_bytes(cp: int, q_values: int, kv_values: int, lse_values: int) -> tuple[int, int]:
    """Bytes the ring's own ops move beside its kernel calls in one attention forward and one
    backward, (forward, backward), the mean over the cp ranks (derived: counted on the CPU by
    validation/torch_cp_ring_traffic.py, every op's inputs and outputs but views, the kernel
    calls, the collectives and allocations, a copy's destination and `zeros_like`'s argument
    not read, in PyTorch's `_templated_ring_attention(_backward)` at v2.13.0,
    whose loops read the same in the late-2024 text; bf16 Q, K and V as torchtitan's mixed
    precision hands them over). `q_values` the rank's Q (b·a·s/cp·d at the heads the kernel
    sees), `kv_values` one of its K and V, `lse_values` its fp32 logsumexp (b·a·s/cp); cp >= 2.

    Forward: the K‖V concatenation and the all-gathered buffer's chunks (`cat`, `clone`), the
    kernel's bf16 output cast to fp32 and merged into the running output and logsumexp
    (`_SDPAMerger.step`: `sub`, `sigmoid`, `mul`, `log_sigmoid`), the last cast back:
    (65·cp - 41)·q/2 + 8·cp·kv + 49·(cp - 1)·lse bytes. Backward: the fp32 accumulators'
    zeroing and adds (`zeros_like`, `add_`), the K‖V and dK‖dV concatenations and their
    copies, the casts back to bf16: (23·cp + 17)·q/2 + (47·cp + 33)·kv + 2·(cp - 1)·lse bytes.
    A plain flash call moves none of it; the forward's sum of all ranks grows with cp, the
    backward's mostly with the K‖V side."""
    forward = -(-(65 * cp - 41) * q_values // 2) + 8 * cp * kv_values + 49 * (cp - 1) * lse_values
    backward = -(-(23 * cp + 17) * q_values // 2) + (47 * cp + 33) * kv_values
    return forward, backward + 2 * (cp - 1) * lse_values


def torchtitan_ring_moved_bytes(spec, heads_r: int, kv_heads_r: int) -> tuple[int, int]:
    """`ring_moved_bytes` of one attention call of `spec`, (forward, backward); (0, 0) where
    it does not run PyTorch's ring attention (`uses_ring_attention`). `heads_r` and
    `kv_heads_r`: the rank's query and K/V heads."""
    tokens = _rank_tokens(spec)
    values = ring_values(spec, tokens, heads_r, kv_heads_r)
    if values is None:
        return 0, 0
    return ring_moved_bytes(spec.cp, *values, tokens * heads_r)


def torchtitan_ring_exchange_bytes(spec, heads_r: int, kv_heads_r: int) -> tuple[int, int]:
    """What PyTorch's ring attention sends per attention call of `spec`: (the all-gathered K‖V
    buffer, cp x the rank's bf16 K and V, gathered once in the forward and once in the
    backward; one fp32 dK‖dV accumulator, shifted to the next rank cp times in the backward by
    `all_to_all_single`), counted on the fake process group by validation/
    torch_cp_ring_traffic.py's loops (PyTorch v2.13.0). (0, 0) where it does not run the ring
    (`uses_ring_attention`). `heads_r`, `kv_heads_r`: the rank's query and K/V heads."""
    values = ring_values(spec, _rank_tokens(spec), heads_r, kv_heads_r)
    if values is None:
        return 0, 0
    kv_values = values[1]
    return spec.cp * 2 * kv_values * spec.dtype_bytes, 2 * kv_values * FP32_BYTES


# Transformer Engine's point-to-point context parallelism (Megatron-Core's default
# `cp_comm_type` p2p: `AttnFuncWithCP`, later `AttnFuncWithCPAndKVP2P`): the bytes its own ops
# move around the kernel calls of one attention forward and one backward, the mean over the cp
# ranks, by release, counted on the CPU by validation/te_cp_p2p_traffic.py on each release's
# own text (bf16 sbhd Q, K, V, causal, cuDNN fused attention): the K‖V concatenation and the
# halves of K‖V, Q and O the load-balanced steps copy, the output and logsumexp corrections
# (torch.compile'd, one kernel each), the dQ and dK‖dV accumulation into the ring buffers.
# Each entry: for Q's, one of K and V's and the fp32 logsumexp's bytes, forward then backward,
# the coefficient (per cp, constant, per 1/cp) in quarters: bytes = (a·cp + b + e/cp)/4 ·
# the tensor's bytes. Releases with the same loops share an entry.
# v1.8-v1.9: K and V apart (qkv_layout sbhd_sbhd_sbhd), the halves of K‖V a step needs
# copied with `.contiguous()`
_TE_1_8 = (((9, 7, 0), (4, 12, 0), (22, 18, 0)), ((9, -1, 0), (34, 14, 0), (0, 4, 0)))
# v1.10-v1.13: K and V in one buffer (qkv_layout sbhd_sb2hd), its halves read as they lie
_TE_1_10 = (((9, 7, 0), (0, 16, 0), (22, 18, 0)), ((9, -1, 0), (30, 18, 0), (0, 4, 0)))
# v2.0-v2.1: the backward's second-half logsumexp copied on the ranks that need it only
_TE_2_0 = (_TE_1_10[0], ((9, -1, 0), (30, 18, 0), (0, 4, -4)))
# v2.2: the output corrections of the halves apart (`flash_attn_fwd_out_correction_init`,
# `flash_attn_fwd_second_half_out_correction`)
_TE_2_2 = (((11, -3, 0), (0, 16, 0), (26, 14, 0)), _TE_2_0[1])
# v2.3: dK and dV taken as the kernel writes them side by side (`combine_tensors`)
_TE_2_3 = (_TE_2_2[0], ((9, -1, 0), (18, 14, 0), (0, 4, -4)))
# v2.4 on: the running logsumexp kept in fp32 (no float64 copy and cast back)
_TE_2_4 = (((11, -3, 0), (0, 16, 0), (18, -2, 0)), _TE_2_3[1])
TE_CP_MOVED: dict[str, tuple] = {
    **dict.fromkeys(("te1.8", "te1.9"), _TE_1_8),
    **dict.fromkeys(("te1.10", "te1.11", "te1.12", "te1.13"), _TE_1_10),
    **dict.fromkeys(("te2.0", "te2.1"), _TE_2_0),
    "te2.2": _TE_2_2,
    "te2.3": _TE_2_3,
    **dict.fromkeys(
        TRANSFORMER_ENGINE_RELEASES[TRANSFORMER_ENGINE_RELEASES.index("te2.4") :], _TE_2_4
    ),
}


# MLA's attention (K and V of different head sizes, v2.5 on: `TE_MLA_CP_FIRST_RELEASE`) takes
# the class's `enable_mla` path: K and V flattened into one K‖V buffer, split back into views
# at each step, dK and dV kept apart. The same counting and form as `TE_CP_MOVED`, for Q's
# bytes (which K's equal: every head has its K, at Q's head size), V's (which the output's
# equal) and the logsumexp's; one entry for every release from v2.5 (the same on v2.5-v2.18)
TE_CP_MLA_MOVED = (((0, 8, 0), (11, 5, 0), (18, -2, 0)), ((18, 6, 0), (9, 7, 0), (0, 4, -4)))


def te_p2p_moved_bytes(
    release: str, cp: int, q_values: int, kv_values: int, lse_values: int
) -> tuple[int, int]:
    """Bytes Transformer Engine `release`'s point-to-point context-parallel attention moves
    beside its kernel calls in one attention forward and one backward, (forward, backward),
    the mean over the cp ranks (derived: `TE_CP_MOVED`, counted by validation/
    te_cp_p2p_traffic.py). `q_values` the rank's Q (b·a·s/cp·d), `kv_values` one of its K and
    V at the K/V heads (TE takes grouped K and V as they are), `lse_values` its fp32
    logsumexp (b·a·s/cp); bf16 Q, K, V; cp >= 2."""
    sizes = (2 * q_values, 2 * kv_values, FP32_BYTES * lse_values)
    return _quarter_sums(TE_CP_MOVED[release], cp, sizes)


def te_p2p_mla_moved_bytes(
    cp: int, q_values: int, v_values: int, lse_values: int
) -> tuple[int, int]:
    """`te_p2p_moved_bytes` for MLA (derived: `TE_CP_MLA_MOVED`, counted by validation/
    te_cp_p2p_traffic.py --mla on v2.5-v2.18): `q_values` the rank's Q (b·a·s/cp·(d_nope +
    d_rope)), which K's equal, `v_values` its V (b·a·s/cp·d_v), which the output's equal,
    `lse_values` its fp32 logsumexp; bf16; cp >= 2."""
    sizes = (2 * q_values, 2 * v_values, FP32_BYTES * lse_values)
    return _quarter_sums(TE_CP_MLA_MOVED, cp, sizes)


def _quarter_sums(entry: tuple, cp: int, sizes: tuple[int, int, int]) -> tuple[int, int]:
    """(forward, backward) bytes of a `TE_CP_MOVED`-form `entry` at `cp` for the three
    tensors' `sizes`, each rounded up to a whole byte."""
    moved = []
    for coefficients in entry:
        quarters = sum(
            Fraction(a * cp + b) * size + Fraction(e * size, cp)
            for (a, b, e), size in zip(coefficients, sizes, strict=True)
        )
        moved.append(math.ceil(quarters / 4))
    return moved[0], moved[1]


def cp_moved_bytes(spec, heads_r: int, kv_heads_r: int) -> tuple[int, int]:
    """What the context-parallel attention's own ops move beside the kernel calls of one
    attention call of `spec`, (forward, backward): PyTorch's ring under torchtitan
    (`torchtitan_ring_moved_bytes`), Transformer Engine's point-to-point loops under
    Megatron-Core (`megatron_cp_moved_bytes`); (0, 0) elsewhere."""
    if spec.framework == "megatron":
        return megatron_cp_moved_bytes(spec, framework_version(spec), heads_r, kv_heads_r)
    return torchtitan_ring_moved_bytes(spec, heads_r, kv_heads_r)


def megatron_cp_moved_bytes(spec, release: str, heads_r: int, kv_heads_r: int) -> tuple[int, int]:
    """`te_p2p_moved_bytes` of one attention call of `spec` under Megatron-Core with Transformer
    Engine `release` (its `framework_version`), or `te_a2a_moved_bytes` under `cp_attention`
    a2a; (0, 0) without context parallelism, without a fused attention kernel (Megatron's
    unfused attention has no context parallelism); MLA's ring is `te_p2p_mla_moved_bytes`.
    `heads_r`, `kv_heads_r`: the rank's query and K/V heads."""
    if spec.framework != "megatron" or spec.cp < 2 or spec.attention == "standard":
        return 0, 0
    if uses_a2a(spec):
        return te_a2a_moved_bytes(release, *a2a_tensor_bytes(spec, heads_r, kv_heads_r))
    if uses_te_allgather(spec):
        q, k, _, _ = a2a_tensor_bytes(spec, heads_r, kv_heads_r)
        return te_allgather_moved_bytes(release, spec.cp, q, k)
    a2a_part = (0, 0)
    if uses_hierarchical(spec):
        a2a_part = te_hierarchical_a2a_moved_bytes(
            release, *a2a_tensor_bytes(spec, heads_r, kv_heads_r)
        )
    # the ring's loops see the same number of values per rank under a2a+p2p: s·a2a/cp tokens
    # at 1/a2a of the heads
    tokens = _rank_tokens(spec)
    ring = hierarchical_sizes(spec)[1]
    q, k, v, _ = (size // spec.dtype_bytes for size in a2a_tensor_bytes(spec, heads_r, kv_heads_r))
    if spec.mla:
        forward, backward = te_p2p_mla_moved_bytes(ring, q, v, tokens * heads_r)
    else:
        forward, backward = te_p2p_moved_bytes(release, ring, q, k, tokens * heads_r)
    return forward + a2a_part[0], backward + a2a_part[1]


# Transformer Engine's all-to-all context parallelism (Megatron-Core's `cp_comm_type` a2a,
# `AttnFuncWithCPAndQKVOA2A`, TE v1.11 on): before the kernel Q, K and V each go through an
# all-to-all that gives every rank the whole sequence at 1/cp of the heads, after it the output
# comes back the same way; the backward sends dO (with O up to v2.7) before its kernel and dQ,
# dK, dV after. Around each all-to-all `flash_attn_a2a_communicate` copies the tensor once
# (`movedim(...).contiguous()`) and reorders its sequence chunks once (`index_select`, compiled
# with the moves, one kernel): each reads and writes the tensor, four times its bytes.
A2A_MOVES_PER_BYTE = 4


def _release_at_least(release: str, first: str) -> bool:
    """Whether Transformer Engine `release` is `first` or later (both ckplan's names)."""
    releases = TRANSFORMER_ENGINE_RELEASES
    return releases.index(release) >= releases.index(first)


def a2a_tensor_bytes(spec, heads_r: int, kv_heads_r: int) -> tuple[int, int, int, int]:
    """The rank's Q, K, V and attention output bytes the all-to-alls carry (b·s/cp tokens
    before them, at the rank's heads; MLA's split head sizes, every head with its K and V),
    in the spec's activation dtype."""
    tokens = _rank_tokens(spec)
    if spec.mla:
        qk_dim, v_dim, kv_heads_r = (
            spec.qk_nope_head_dim + spec.qk_rope_head_dim,
            spec.v_head_dim,
            heads_r,
        )
    else:
        qk_dim = v_dim = spec.head_dim
    width = tokens * spec.dtype_bytes
    return (
        width * heads_r * qk_dim,
        width * kv_heads_r * qk_dim,
        width * kv_heads_r * v_dim,
        width * heads_r * v_dim,
    )


def te_a2a_sent_bytes(
    release: str, q: int, k: int, v: int, out: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensors Transformer Engine `release`'s all-to-all context parallelism sends through
    one all-to-all each, (forward, backward), each the rank's whole tensor of that many bytes
    ((cp - 1)/cp of it leaves the rank): forward Q, K, V and the output; backward dO (and the
    saved output, up to v2.7: `TE_A2A_SAVES_KERNEL_OUTPUT`), then dQ, dK, dV
    (`AttnFuncWithCPAndQKVOA2A`, context_parallel.py at v2.3 and v2.9)."""
    resent = () if _release_at_least(release, TE_A2A_SAVES_KERNEL_OUTPUT) else (out,)
    return (q, k, v, out), (*resent, out, q, k, v)


def te_hierarchical_a2a_sent_bytes(
    release: str, q: int, k: int, v: int, out: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensors the all-to-all part of Transformer Engine `release`'s a2a+p2p context
    parallelism sends through one all-to-all each over its group, (forward, backward): Q, K, V
    before the ring and the output after it; backward the saved output and dO before it (dO
    alone from v2.15: `TE_HIERARCHICAL_SAVES_KERNEL_OUTPUT`), dQ, dK, dV after
    (`AttnFuncWithCPAndKVP2P`, the "communicate for the 'a2a' part of 'a2a+p2p'" blocks at
    v1.12, v2.9 and v2.16)."""
    kept = _release_at_least(release, TE_HIERARCHICAL_SAVES_KERNEL_OUTPUT)
    return (q, k, v, out), ((out,) if kept else (out, out)) + (q, k, v)


def te_hierarchical_a2a_moved_bytes(
    release: str, q: int, k: int, v: int, out: int
) -> tuple[int, int]:
    """Bytes the all-to-all part of a2a+p2p moves beside the kernels, (forward, backward):
    `A2A_MOVES_PER_BYTE` times each tensor it sends (`te_hierarchical_a2a_sent_bytes`; the
    same `flash_attn_a2a_communicate` as the all-to-all class). The ring's loops over the
    rest, at the ring's size, are `te_p2p_moved_bytes` (counted together on the CPU by
    validation/te_cp_p2p_traffic.py --comm=a2a+p2p)."""
    forward, backward = te_hierarchical_a2a_sent_bytes(release, q, k, v, out)
    return A2A_MOVES_PER_BYTE * sum(forward), A2A_MOVES_PER_BYTE * sum(backward)


def te_a2a_moved_bytes(release: str, q: int, k: int, v: int, out: int) -> tuple[int, int]:
    """Bytes Transformer Engine `release`'s all-to-all context parallelism moves beside its
    kernel calls in one attention forward and one backward (derived: `A2A_MOVES_PER_BYTE`
    times each tensor it sends, `te_a2a_sent_bytes`; counted on the CPU by validation/
    te_cp_p2p_traffic.py --comm a2a on each release's text, the same on every rank and cp)."""
    forward, backward = te_a2a_sent_bytes(release, q, k, v, out)
    return A2A_MOVES_PER_BYTE * sum(forward), A2A_MOVES_PER_BYTE * sum(backward)


def te_saved_output_bytes(spec, heads_r: int, kv_heads_r: int) -> int:
    """What Transformer Engine's context parallelism saves for the backward beyond the ring's:
    a second attention output, the kernel's own, while the output projection saves the tensor
    returned. The all-to-all from v2.8 (`TE_A2A_SAVES_KERNEL_OUTPUT`) and a2a+p2p from v2.15
    (`TE_HIERARCHICAL_SAVES_KERNEL_OUTPUT`) save the output before its all-to-all (earlier
    releases the one returned: 0); the all-gather saves each chunk's
    output (`out_per_step`) and returns a copy of both (`AttnFuncWithCPAndKVAllGather`, v1.10
    on). 0 elsewhere."""
    release = framework_version(spec)
    if (
        uses_te_allgather(spec)
        or (uses_a2a(spec) and _release_at_least(release, TE_A2A_SAVES_KERNEL_OUTPUT))
        or (
            uses_hierarchical(spec)
            and _release_at_least(release, TE_HIERARCHICAL_SAVES_KERNEL_OUTPUT)
        )
    ):
        return a2a_tensor_bytes(spec, heads_r, kv_heads_r)[3]
    return 0


def te_hierarchical_backward_workspace_bytes(
    release: str, q: int, k: int, v: int, out: int, ring_at_call: int, ring_at_end: int
) -> int:
    """What a2a+p2p's backward holds beyond the kernels' dQ, dK, dV, around the ring's own
    transient: `ring_at_call` at its kernel calls (with the kernel's workspace), `ring_at_end`
    once its loops are done (`te_p2p_backward_live_bytes`; derived from
    `AttnFuncWithCPAndKVP2P.backward` the same way as `te_a2a_backward_workspace_bytes`,
    checked by validation/te_cp_p2p_traffic.py --comm=a2a+p2p --memory). dO after its
    all-to-all (and O, up to v2.14) stays beside the ring until the backward returns; after
    the loops, their buffers still held, dQ, dK, dV go back one after the other."""
    sent = te_hierarchical_a2a_sent_bytes(release, q, k, v, out)[1]
    kept = (len(sent) - 3) * out
    return kept + max(ring_at_call, ring_at_end + _a2a_gradients_sent(q, k, v))


def _a2a_gradients_sent(q: int, k: int, v: int) -> int:
    """The most `flash_attn_a2a_communicate` holds while it sends dQ, dK and dV back one after
    the other (`te_a2a_backward_workspace_bytes`)."""
    return max(3 * q + 2 * k + v, 2 * q + 3 * k + 2 * v, 2 * q + 2 * k + 3 * v)


def te_a2a_backward_workspace_bytes(
    release: str, q: int, k: int, v: int, out: int, kernel_workspace: int
) -> int:
    """What Transformer Engine `release`'s all-to-all attention backward holds beyond the
    kernel's dQ, dK, dV and what autograd hands it and saved (derived from
    `AttnFuncWithCPAndQKVOA2A.backward` and `flash_attn_a2a_communicate`, v2.3 and v2.9;
    checked on the CPU by validation/te_cp_p2p_traffic.py --comm a2a --memory). dO after its
    all-to-all (and, up to v2.7, O after its own) stays until the backward returns: beside the
    kernel and its `kernel_workspace`. After the kernel the gradients go out one after the
    other, each reordered (R), received (A) and copied back into place (F): the reordered
    ones stay in the list until the call returns, a received buffer until its copy, so the
    most at once is R of all three, F and A of the one being copied and F of those before:
    max(3q + 2k + v, 2q + 3k + 2v, 2q + 2k + 3v) for Q's, K's and V's bytes."""
    resent = len(te_a2a_sent_bytes(release, q, k, v, out)[1]) - 3
    kept = resent * out  # dO, and O up to v2.7, at the kernel's layout
    return kept + max(kernel_workspace, _a2a_gradients_sent(q, k, v))


def attention_backward_workspace_bytes(
    spec, heads_r: int, kv_heads_r: int, kernel_workspace: int
) -> int:
    """The attention core's backward transient: `kernel_workspace` (the kernel's own, ckplan.
    model.ops), or under Transformer Engine's all-to-all, all-gather or a2a+p2p context
    parallelism `te_a2a_backward_workspace_bytes`, `te_allgather_backward_workspace_bytes` or
    `te_hierarchical_backward_workspace_bytes` around it."""
    release = framework_version(spec)
    if uses_a2a(spec):
        tensors = a2a_tensor_bytes(spec, heads_r, kv_heads_r)
        return te_a2a_backward_workspace_bytes(release, *tensors, kernel_workspace)
    if uses_te_allgather(spec):
        q, k, _, _ = a2a_tensor_bytes(spec, heads_r, kv_heads_r)
        return te_allgather_backward_workspace_bytes(release, spec.cp, q, k, kernel_workspace)
    ring_ranks = hierarchical_sizes(spec)[1]
    uses_te_ring = spec.framework == "megatron" and spec.cp > 1 and spec.attention != "standard"
    at_call, at_end = 0, 0
    if uses_te_ring and ring_ranks > 1:
        # the ring's loops at its size see the rank's bytes (`megatron_cp_moved_bytes`)
        q, k, v, _ = a2a_tensor_bytes(spec, heads_r, kv_heads_r)
        if spec.mla:
            at_call = at_end = te_p2p_mla_backward_live_bytes(q, k, v)
        else:
            at_call, at_end = te_p2p_backward_live_bytes(release, ring_ranks, q, k)
    if uses_hierarchical(spec):
        tensors = a2a_tensor_bytes(spec, heads_r, kv_heads_r)
        return te_hierarchical_backward_workspace_bytes(
            release, *tensors, at_call + kernel_workspace, at_end
        )
    return max(at_call + kernel_workspace, at_end)


# What Transformer Engine's point-to-point backward (`AttnFuncWithCP(AndKVP2P).backward`) holds
# beyond what it is handed and saved and beyond the dQ, dK, dV it returns, on its busiest rank:
# the received K‖V buffers, the dK‖dV buffers passed round the ring, the dQ buffer (fp32 in
# places) and the halves the load-balanced steps copy. Found by validation/
# te_cp_p2p_traffic.py --memory (its live-bytes tracker on the release's own text; bf16 sbhd,
# causal, cuDNN fused attention) at cp 2, 3, 4 and 8, K/V at the query heads and at a half
# (and, found once, a quarter, where v1.12-v1.13's other form wins) of them: whatever cp but on
# v1.8-v1.9, whose middle ranks hold one K/V more at a call. Each entry: (linear forms of Q's
# and one of K's and V's bytes whose largest is the live set at a kernel call, those whose
# largest is the live set after the loops), the coefficients (of q, of kv) as Fractions.
_F = Fraction
TE_P2P_LIVE: dict[str, tuple] = {
    # v1.8-1.9 at cp 2 (`te_p2p_backward_live_bytes` adds the middle ranks' K/V at cp >= 3)
    **dict.fromkeys(("te1.8", "te1.9", "te1.10", "te1.11"), (((_F(3, 2), 12),), ((_F(3, 2), 12),))),
    # v1.12-1.13: the first rank and the others peak at different shares of Q and K/V
    **dict.fromkeys(("te1.12", "te1.13"), (((_F(3, 2), 10), (2, 9)), ((1, 12), (2, 9)))),
    **dict.fromkeys(("te2.0", "te2.1", "te2.2"), (((1, _F(289, 32)),), ((1, _F(161, 16)),))),
    **dict.fromkeys(("te2.3", "te2.4", "te2.5", "te2.6", "te2.7"), (((1, 10),), ((1, 12),))),
    **dict.fromkeys(
        TRANSFORMER_ENGINE_RELEASES[TRANSFORMER_ENGINE_RELEASES.index("te2.8") :],
        (((1, 8),), ((1, 8),)),
    ),
}


def te_p2p_backward_live_bytes(release: str, cp: int, q: int, kv: int) -> tuple[int, int]:
    """(What Transformer Engine `release`'s point-to-point backward holds at a kernel call, what
    it holds after its loops) beyond what it is handed and saved and the dQ, dK, dV it returns,
    on its busiest rank (derived: `TE_P2P_LIVE`), for the rank's Q bytes `q` and one of its
    K and V `kv`. From v2.8 q + 8·kv both: the two received K‖V buffers, the two dK‖dV ones
    and the dQ buffer."""
    at_call, at_end = (
        math.ceil(max(a * q + b * kv for a, b in forms)) for forms in TE_P2P_LIVE[release]
    )
    if release in ("te1.8", "te1.9") and cp >= 3:
        at_call += kv  # a middle rank's copy of the received K and V halves
    return at_call, at_end


def te_p2p_mla_backward_live_bytes(q: int, k: int, v: int) -> int:
    """`te_p2p_backward_live_bytes` for MLA's attention, the same at a kernel call and after
    the loops on every release that runs it (v2.5 on, found by validation/
    te_cp_p2p_traffic.py --mla --memory on v2.5-v2.18): q + 4·(k + v) for the rank's Q, K and
    V bytes, the two received K‖V buffers, the two dK‖dV ones and the dQ buffer, as v2.8's
    q + 8·kv where K and V are one size."""
    return q + 4 * (k + v)


# Transformer Engine's all-gather context parallelism (Megatron-Core's `cp_comm_type`
# all_gather, `AttnFuncWithCPAndKVAllGather`, TE v1.10 on; the Llama 3 paper's §3.3.2): K and
# V all-gathered over the cp group and put in sequence order (`index_select`), then one kernel
# call for each of the rank's two load-balanced query chunks over the keys before it, on two
# streams, each chunk's output copied into the one returned; the backward gathers K and V
# again, adds each call's dK, dV into zeroed whole-sequence buffers, reorders them and
# reduce-scatters them. The bytes its own ops move beside the kernel calls, (forward,
# backward), counted on the CPU by validation/te_cp_p2p_traffic.py --comm=allgather, the same
# on every rank, for Q's bytes and one of K's and V's, each entry (Q's, K/V's per cp, K/V's
# constant): v1.10 picks each call's keys out of the gathered K and V (`index_select` per
# call), v1.11 on reorders them once and slices each call's prefix (no copy in sbhd).
TE_ALLGATHER_MOVED = {
    "te1.10": ((2, 6, 1), (2, 18, 2)),
    "te1.11": ((2, 4, 0), (2, 16, 3)),
}
# the backward's most live bytes beside what it is handed and saved, in halves of Q's and of
# one of K's and V's bytes (Q's, K/V's per cp, K/V's constant), counted by the same script's
# --memory on its busiest rank: (the most at a kernel call, the most at all)
TE_ALLGATHER_LIVE = {
    "te1.10": ((4, 16, 2), (5, 20, 2)),
    "te1.11": ((3, 10, 0), (4, 14, 2)),
}


def _allgather_family(release: str) -> str:
    """The release whose all-gather loops `release` runs (`TE_ALLGATHER_MOVED`)."""
    return "te1.11" if _release_at_least(release, "te1.11") else "te1.10"


def te_allgather_moved_bytes(release: str, cp: int, q: int, kv: int) -> tuple[int, int]:
    """Bytes Transformer Engine `release`'s all-gather context parallelism moves beside its
    kernel calls in one attention forward and one backward (derived: `TE_ALLGATHER_MOVED`).
    From v1.11, forward: the reorder of the gathered K and V (4·cp·kv) and the two chunks'
    outputs copied into place (2·q); backward: the reorder again (4·cp·kv), the zeroed dK, dV
    buffers (2·cp·kv), the adds of each call's dK, dV into them, each reading the buffer's part
    and the call's and writing the part, over the 2·cp + 1 half-chunks of keys the two calls
    see ((6·cp + 3)·kv), the reorder of dK, dV (4·cp·kv) and the dQ chunks' copies (2·q).
    `q` the rank's Q bytes, `kv` one of its K and V; bf16, causal, no window."""
    moved = []
    for q_coefficient, per_cp, constant in TE_ALLGATHER_MOVED[_allgather_family(release)]:
        moved.append(q_coefficient * q + (per_cp * cp + constant) * kv)
    return moved[0], moved[1]


def te_allgather_backward_workspace_bytes(
    release: str, cp: int, q: int, kv: int, kernel_workspace: int
) -> int:
    """What Transformer Engine `release`'s all-gather attention backward holds beyond the dQ,
    dK, dV it returns (q + 2·kv) and what it is handed and saved (derived: `TE_ALLGATHER_LIVE`,
    the busiest rank): the gathered and reordered K and V, the zeroed dK, dV buffers and the
    calls' gradients, at a kernel call (beside the call's own workspace, half of
    `kernel_workspace`: each call has half the rank's queries) or after the last. From v1.11
    at a call 1.5·q + 5·cp·kv, at most 2·q + (7·cp + 1)·kv."""
    at_call, most = te_allgather_backward_live_bytes(release, cp, q, kv)
    return max(at_call + math.ceil(kernel_workspace / 2), most) - (q + 2 * kv)


def te_allgather_backward_live_bytes(release: str, cp: int, q: int, kv: int) -> tuple[int, int]:
    """`TE_ALLGATHER_LIVE` in bytes: (the most the all-gather backward holds at a kernel call,
    the most at all) beyond what it is handed and saved, its busiest rank, for the rank's Q
    bytes `q` and one of its K and V `kv`."""
    at_call, most = (
        math.ceil((a * q + (b * cp + c) * kv) / 2)
        for a, b, c in TE_ALLGATHER_LIVE[_allgather_family(release)]
    )
    return at_call, most
