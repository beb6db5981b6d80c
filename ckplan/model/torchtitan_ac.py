"""Which per-op policy each torchtitan release runs: the one answer that the torchtitan export
(ckplan.exports.torchtitan) and the plan search (ckplan.plan.search) both read.

torchtitan 0.2.x's op-level selective AC (`selective_ac_option = "op"`,
torchtitan/distributed/activation_checkpoint.py at v0.2.2) is ckplan's `sac`
(ckplan.model.op_policy, `TORCHTITAN_POLICY`). torchtitan 0.3.0's `SelectiveAC` (the wheel
torchtitan-0.3.0-py3-none-any.whl: torchtitan/distributed/activation_checkpoint.py,
`_get_default_save_ops`; torchtitan/models/llama3/__init__.py, `_build_llama3_layers`) is
ckplan's `sac-fused` on a dense Llama 3 block without biases: one fused wqkv GEMM counted by
the every-second-mm rule, FlexAttention's compiled region kept whole in eager blocks, its
output and logsumexp in blocks torch.compile'd after wrapping (`op_policy.flex_units`;
measured: tests/test_torchtitan_sac.py). Its save list also holds PyTorch's `compute_intensive_ops`
(torch 2.13: `aten.addmm`, `aten.bmm`, `aten._scaled_mm`) outside the every-second rule and
`aten.topk`, so it keeps more than either policy with biases, torchao float8 or MoE routing.
No release runs a hand-picked op list (`sac:OP,...`).
"""

from __future__ import annotations

from ckplan.model.op_policy import (
    TORCHTITAN_03_POLICY,
    TORCHTITAN_03_WORD,
    TORCHTITAN_POLICY,
    check_policy_model,
    parse_policy,
    policy_fit_reason,
)
from ckplan.model.spec import ModelSpec

RELEASES = ("0.3", "0.2")  # torchtitan 0.3.0 (command line), 0.2.x (TOML job file)
DEFAULT_RELEASE = "0.3"


def spec_release(spec: ModelSpec) -> str:
    """The release (`RELEASES`) `spec`'s torchtitan runs: 0.3 at `framework_version` 0.3 (the
    default), 0.2 at the release of December 2024, whose op-level selective AC is 0.2.x's."""
    from ckplan.model.frameworks import framework_version

    return "0.3" if framework_version(spec) == "0.3" else "0.2"


def policy_reason(spec: ModelSpec, policy: str, release: str = DEFAULT_RELEASE) -> str | None:
    """Why torchtitan `release` does not run the per-op policy `policy` (canonical `sac:...`
    text) on `spec`'s layers, or None."""
    if policy == TORCHTITAN_03_POLICY:
        if release != "0.3":
            return (
                f"the policy {TORCHTITAN_03_WORD}: torchtitan 0.3.0's SelectiveAC; 0.2.x's "
                "op-level selective AC is the policy sac (--torchtitan-version 0.3)"
            )
        return fused_reason_03(spec)
    if policy == TORCHTITAN_POLICY:
        return sac_reason_03(spec) if release == "0.3" else None
    return (
        f"the per-op policy {policy}: torchtitan's op-level selective AC "
        f"is the policy sac (0.2.x) or {TORCHTITAN_03_WORD} (0.3.0) only"
    )


def release_policy(spec: ModelSpec, release: str = DEFAULT_RELEASE) -> str | None:
    """The per-op policy (canonical text) torchtitan `release` runs on `spec`'s layers and
    ckplan models there, or None: `sac` for 0.2.x, `sac-fused` for 0.3.0, each where the
    model's policies apply (`check_policy_model`, `policy_fit_reason`) and the release keeps
    what the policy says (`policy_reason`)."""
    if check_policy_model(spec) is not None:
        return None
    policy = TORCHTITAN_03_POLICY if release == "0.3" else TORCHTITAN_POLICY
    if policy_fit_reason(spec, parse_policy(policy)) or policy_reason(spec, policy, release):
        return None
    return policy


def sac_reason_03(spec: ModelSpec) -> str:
    """Why torchtitan 0.3.0's SelectiveAC keeps other outputs than ckplan's `sac` (0.2.2's op
    SAC), the most specific reason first.

    Every Llama 3 flavour of 0.3.0 is built with `fuse_qkv=True` (torchtitan/models/llama3/
    __init__.py, `_build_llama3_layers`): one `wqkv` GEMM (`FusedQKVLinear`, torchtitan/models/
    common/attention.py), so the every-second-mm rule counts wqkv, wo, w1, w3, w2 and keeps
    wqkv's output (Q, K and V), w1's and w2's (measured: tests/test_torchtitan_sac.py). Its
    language models attend with FlexAttention or varlen attention, never SDPA
    (models/common/config_utils.py, `get_attention_config`); FlexAttention runs compiled with
    `wrap_inductor_compiled_regions` (attention.py, `FlexAttention.inductor_configs`), so the
    selective checkpoint sees one `inductor_compiled_code` op, which SelectiveAC saves, and
    caches every output of the compiled forward: the attention output, its logsumexp and, as
    the backward reads them, its inputs, the rotated Q and K and V's contiguous copy. On a
    small block (tests/test_torchtitan_sac.py: FlexAttention has no CPU backward, so it runs
    AOTAutograd's min-cut partition inside `inductor_compiled_code`, as inductor wraps it) that
    is ckplan's `sac:matmuls%2,k_proj,rope,attention` plus V's copy, 70,144 bytes where `sac`
    keeps 49,664."""
    if spec.bias or spec.qkv_bias:
        return (
            "the policy sac with linear biases: torchtitan 0.3.0's SelectiveAC saves every "
            "aten.addmm outside its every-second-matmul rule (--torchtitan-version 0.2)"
        )
    if spec.precision == "float8":
        return (
            "the policy sac under float8: torchtitan 0.3.0's SelectiveAC saves every "
            "aten._scaled_mm (--torchtitan-version 0.2)"
        )
    if spec.experts:
        return (
            "the policy sac on MoE layers: torchtitan 0.3.0's SelectiveAC also saves the "
            "routing's aten.topk (--torchtitan-version 0.2)"
        )
    return (
        "the policy sac: torchtitan 0.3.0's Llama 3 runs one fused wqkv GEMM, so SelectiveAC "
        "keeps K's projection too, and saves compiled FlexAttention's whole region, whose "
        f"outputs include the rotated Q and K and a copy of V: that is the policy "
        f"{TORCHTITAN_03_WORD} (or --torchtitan-version 0.2)"
    )


def fused_reason_03(spec: ModelSpec) -> str | None:
    """Why torchtitan 0.3.0's SelectiveAC keeps other outputs than ckplan's `sac-fused` on
    `spec`, or None. `sac-fused` models the every-second-mm rule over wqkv, wo, w1, w3, w2 and
    FlexAttention's region (ckplan.model.op_policy, `flex_region_copy_bytes`), measured on
    0.3.0's dense Llama 3 block (tests/test_torchtitan_sac.py); the rest of 0.3.0's save list
    (torchtitan/distributed/activation_checkpoint.py, `_get_default_save_ops`: PyTorch's
    `compute_intensive_ops`, `aten.topk`) saves outputs it does not model."""
    if spec.bias or spec.qkv_bias:
        return (
            f"the policy {TORCHTITAN_03_WORD} with linear biases: torchtitan 0.3.0's "
            "SelectiveAC saves every aten.addmm outside its every-second-matmul rule"
        )
    if spec.precision == "float8":
        return (
            f"the policy {TORCHTITAN_03_WORD} under float8: torchtitan 0.3.0's SelectiveAC "
            "saves every aten._scaled_mm outside its every-second-matmul rule"
        )
    if spec.experts:
        return (
            f"the policy {TORCHTITAN_03_WORD} on MoE layers: torchtitan 0.3.0's SelectiveAC "
            "also saves the routing's aten.topk and runs experts ckplan's units do not measure"
        )
    return None
