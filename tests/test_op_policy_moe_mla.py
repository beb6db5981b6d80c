"""Per-op policies on MoE and MLA layers: the unit table, and what PyTorch's selective
checkpointing keeps on torchtitan-style DeepSeek-V3 and Mixtral blocks with the same policy."""

import pytest
from export_snippet import recording_snippet

from ckplan.model.op_policy import (
    FORCE_RECOMPUTED,
    kept_units,
    parse_policy,
    policy_tape_bytes,
    unit_ops,
)
from ckplan.model.spec import spec_from_mapping

BASE = {
    "name": "tiny-moe",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "ffn_hidden": 96,
    "seq": 16,
    "micro_batch": 2,
    "vocab": 0,
    "dtype_bytes": 4,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "positions": "rope",
    "dropout": 0,
    "bias": False,
    "framework": "torchtitan",
    "experts": 4,
    "top_k": 2,
    "moe_ffn_hidden": 32,
}
# DeepSeek-V3's shape, small: query and KV latents, one shared expert. Q/K heads of 8 + 8 dims
# and V of 16, so that PyTorch's CPU flash kernel runs (it needs equal head dims).
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
       "v_head_dim": 16, "shared_experts": 1, "kv_heads": 4}  # fmt: skip


def spec(mla: bool, **changes):
    return spec_from_mapping({**BASE, **(MLA if mla else {}), **changes})


def test_units_by_hand():
    """The DeepSeek-style block's units and their outputs, bytes by hand (fp32, T = 32 tokens,
    tp 1): latents 32·32 and 32·(16 + 8), Q 32·4·16, K-nope and V 32·4·(8 + 16), O and the LSE
    32·4·16 + 32·4, the logits 32·4, the R = T·k = 64 routed rows 32 and 64 wide."""
    s = spec(True)
    got = {unit.name: unit.output_bytes for unit in unit_ops(s)}
    T = 32
    assert got["q_down"] == 4 * T * 32 and got["q_up"] == 4 * T * 4 * 16
    assert got["kv_down"] == 4 * T * (16 + 8) and got["kv_up"] == 4 * T * 4 * (8 + 16)
    assert got["attention"] == 4 * (T * 4 * 16 + T * 4)
    assert got["router"] == 4 * T * 4
    assert got["expert_gate"] == got["expert_up"] == 4 * 64 * 32
    assert got["expert_fc2"] == 4 * 64 * 64
    assert got["shared_gate_proj"] == 4 * T * 32
    # torchtitan's combine: the fp32 copy of the S = 64 rows' outputs and their fp32 scores;
    # forward, the scores' gather (S int64 indices and S scores read, S written) and the cast
    # (4 bytes read and 4 written per value in fp32); the weighting's whole traffic is in the
    # table's un-permutation, split between the two units
    from ckplan.model.ops import layer_ops, representative_kind

    units = {unit.name: unit for unit in unit_ops(s)}
    S, h = 64, 64
    assert got["weighting_inputs"] == 4 * S * (h + 1)
    assert units["weighting_inputs"].op.forward_bytes == (8 + 4 + 4) * S + (4 + 4) * S * h
    (table,) = [op for op in layer_ops(s, representative_kind(s)) if op.name == "unpermute"]
    split = units["weighting_inputs"].op.forward_bytes + units["unpermute"].op.forward_bytes
    assert split == table.forward_bytes
    # the weighting's whole traffic (B = 4): forward the gather and the cast, the product
    # (4·S·h and 4·S read, 4·S·h written), the cast back (4·S·h read, B·S·h written);
    # backward the cast back's, the two gradients of the product, the cast's and the gather's
    from ckplan.model.moe import combine_weighting_moved
    from ckplan.model.op import LayerShapes

    forward = 16 * S + 8 * S * h + (8 * S * h + 4 * S) + (4 * S * h + 4 * S * h)
    backward = 8 * S * h + (8 * S * h + 4 * S) + (8 * S * h + 4 * S) + 8 * S * h + 16 * S
    assert combine_weighting_moved(s, LayerShapes.of(s)) == (forward, backward) == (99_584, 132_608)
    # the mm counter sees the linears only, in torchtitan's order; the experts are grouped GEMMs
    matmuls = [unit.name for unit in unit_ops(s) if unit.matmul]
    assert matmuls == ["q_down", "q_up", "kv_down", "kv_up", "out_proj", "router",
                       "shared_gate_proj", "shared_up_proj", "shared_fc2"]  # fmt: skip
    assert [unit.name for unit in unit_ops(s) if unit.grouped] == [
        "expert_gate", "expert_up", "expert_fc2"]  # fmt: skip
    # torchtitan force-recomputes the router's gate and leaves it out of the count
    assert kept_units(s, parse_policy("sac")) == (
        "q_down", "kv_down", "attention", "out_proj", "shared_up_proj")  # fmt: skip
    assert "router" in kept_units(s, parse_policy("sac:router"))


def test_all_to_all_kept_by_sac_with_expert_parallelism(spec_of):
    """Mixtral-8x7B with ep 8: torchtitan's list keeps the dispatch and combine all-to-alls'
    outputs (R/etp and S rows of h), and a policy that keeps them re-runs no collective."""
    from ckplan.hardware.step_time import layer_time
    from ckplan.inputs.gpus import load_gpu

    s = spec_of("mixtral-8x7b", tp=2, sp=True, pp=4, microbatches=16, ep=8, dp=8, zero=3,
                framework="torchtitan")  # fmt: skip
    units = [unit for unit in unit_ops(s) if unit.name in ("dispatch", "combine")]
    assert len(units) == 2 and all(unit.output_bytes > 0 for unit in units)
    assert {"dispatch", "combine"} <= set(kept_units(s, parse_policy("sac")))
    gpu = load_gpu("h100-sxm")
    kept = layer_time(s, gpu, None, ("sac:matmuls,attention,all_to_all",))
    dropped = layer_time(s, gpu, None, ("sac:matmuls,attention",))
    assert kept.core_comm < dropped.core_comm
    assert dropped.core_comm - kept.core_comm == pytest.approx(dropped.expert_forward_comm)


def test_policy_names_parse_with_torchtitan_and_hugging_face_spellings():
    assert parse_policy("sac:wq_a,wkv_b,gate,experts.w1") == parse_policy(
        "sac:q_down,kv_up,router,expert_gate"
    )
    assert parse_policy("sac:q_a_proj,kv_a_proj_with_mqa") == parse_policy("sac:q_down,kv_down")


def _torch_block(torch, s):
    """A torchtitan-style block (torchtitan/models/deepseek_v3/model/model.py and
    torchtitan/models/moe/moe.py at v0.2.2): RMSNorm; MLA (wq_a, q_norm, wq_b; wkv_a, kv_norm,
    wkv_b; RoPE on the rope parts; SDPA; wo) or Llama attention (wq, wk, wv, RoPE, SDPA with
    GQA, wo); residual; RMSNorm; the MoE: gate (a linear), softmax in fp32, top-k, tokens sorted
    by expert, the experts as torch._grouped_mm (silu(x·w1ᵀ) · x·w3ᵀ, then ·w2ᵀ), the shared
    expert; the combine as torchtitan 0.3.0's LocalTokenDispatcher runs it (models/common/
    token_dispatcher.py: the scores gathered into the experts' order in `_local_reorder`, the
    outputs cast to fp32 and multiplied by them, cast back and scatter-added into the tokens'
    rows), residual."""
    nn, F = torch.nn, torch.nn.functional
    h, a, E, k, Fe = s.hidden, s.heads, s.experts, s.top_k, s.moe_ffn_hidden

    def rope(x):  # (b, s, heads, d)
        n, d = x.shape[1], x.shape[-1]
        angles = torch.arange(n)[:, None] * (10000.0 ** (-torch.arange(d // 2) / (d // 2)))
        cos, sin = (t[None, :, None, :].to(x.dtype) for t in (angles.cos(), angles.sin()))
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)
            if s.mla:
                nope, r, v = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
                self.wq_a = nn.Linear(h, s.q_lora_rank, bias=False)
                self.q_norm = nn.RMSNorm(s.q_lora_rank)
                self.wq_b = nn.Linear(s.q_lora_rank, a * (nope + r), bias=False)
                self.wkv_a = nn.Linear(h, s.kv_lora_rank + r, bias=False)
                self.kv_norm = nn.RMSNorm(s.kv_lora_rank)
                self.wkv_b = nn.Linear(s.kv_lora_rank, a * (nope + v), bias=False)
                self.wo = nn.Linear(a * v, h, bias=False)
            else:
                g, d = s.kv_heads, s.head_dim
                self.wq, self.wk = nn.Linear(h, a * d, bias=False), nn.Linear(h, g * d, bias=False)
                self.wv, self.wo = nn.Linear(h, g * d, bias=False), nn.Linear(a * d, h, bias=False)
            self.gate = nn.Linear(h, E, bias=False)
            scale = 0.1
            self.w1 = nn.Parameter(scale * torch.randn(E, Fe, h))
            self.w3 = nn.Parameter(scale * torch.randn(E, Fe, h))
            self.w2 = nn.Parameter(scale * torch.randn(E, h, Fe))
            if s.shared_ffn_hidden:
                S = s.shared_ffn_hidden
                self.s1, self.s3 = nn.Linear(h, S, bias=False), nn.Linear(h, S, bias=False)
                self.s2 = nn.Linear(S, h, bias=False)

        def attention(self, y):
            b, n, _ = y.shape
            if s.mla:
                nope, r = s.qk_nope_head_dim, s.qk_rope_head_dim
                q = self.wq_b(self.q_norm(self.wq_a(y))).view(b, n, a, nope + r)
                q_nope, q_pe = torch.split(q, [nope, r], dim=-1)
                q = torch.cat([q_nope, rope(q_pe)], dim=-1)
                kv, k_pe = torch.split(self.wkv_a(y), [s.kv_lora_rank, r], dim=-1)
                k_pe = rope(k_pe.unsqueeze(2))
                kv = self.wkv_b(self.kv_norm(kv)).view(b, n, a, nope + s.v_head_dim)
                k_nope, v = torch.split(kv, [nope, s.v_head_dim], dim=-1)
                k = torch.cat([k_nope, k_pe.expand(-1, -1, a, -1)], dim=-1)
                gqa = False
            else:
                g, d = s.kv_heads, s.head_dim
                q, k = rope(self.wq(y).view(b, n, a, d)), rope(self.wk(y).view(b, n, g, d))
                v, gqa = self.wv(y).view(b, n, g, d), True
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=gqa,
            )  # fmt: skip
            return self.wo(out.transpose(1, 2).reshape(b, n, -1))

        def moe(self, z):
            b, n, _ = z.shape
            x = z.reshape(-1, h)
            scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
            top_scores, chosen = torch.topk(scores, k=k, dim=-1)
            with torch.no_grad():
                counts = torch.histc(chosen.view(-1).float(), bins=E, min=0, max=E)
                order = torch.argsort(chosen.view(-1), stable=True)
                offsets = torch.cumsum(counts, dim=0).to(torch.int32)
            sorted_scores = top_scores.view(-1)[order]
            token_of_row = order // k
            routed = x[token_of_row]
            hidden = F.silu(torch._grouped_mm(routed, self.w1.transpose(-2, -1), offs=offsets))
            hidden = hidden * torch._grouped_mm(routed, self.w3.transpose(-2, -1), offs=offsets)
            routed_out = torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=offsets)
            out = self.s2(F.silu(self.s1(x)) * self.s3(x)) if s.shared_ffn_hidden else None
            weighted = routed_out.to(torch.float32) * sorted_scores.reshape(-1, 1)
            index = token_of_row.reshape(-1, 1).expand(-1, h)
            combined = torch.zeros_like(x).scatter_add(0, index, weighted.to(x.dtype))
            combined = combined if out is None else combined + out
            return combined.reshape(b, n, h)

        def forward(self, x):
            hidden = x + self.attention(self.attention_norm(x))
            return hidden + self.moe(self.ffn_norm(hidden))

    return Block()


def _policy_fn(torch, s, policy):
    """torchtitan's `_custom_policy` generalised to an `OpPolicy`: aten.mm outputs by the
    every-K-th rule (the router's gate re-run and not counted) or by name in the order the
    layer calls them, aten._grouped_mm outputs by
    name in their order, the SDPA kernels' outputs when the policy keeps the attention, and
    with `weighting_inputs` the two tensors the combine's fp32 product saves: the cast of the
    experts' (bf16) outputs to fp32 (aten._to_copy of an (S, h) tensor) and the scores gathered
    into the experts' order (aten.index of the flat fp32 scores)."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy

    units = unit_ops(s)
    matmuls = [unit for unit in units if unit.matmul]
    grouped = [unit for unit in units if unit.grouped]
    aten = torch.ops.aten
    attention_ops = {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    # The element-wise units' outputs in `_torch_block`, by aten op and its count in a layer
    # (traced on torch 2.13 CPU, fp32): nn.RMSNorm's last mul; RoPE's cat (MLA: the cats that
    # join the no-RoPE and RoPE parts of Q and of K); the residual adds. The routing, the
    # permutation and the experts' activation keep tensors of their own (`Unit.internal`) in
    # ckplan's table that this block does not: left out.
    if s.mla:
        elementwise = {(aten.mul.Tensor, 2): "norm1", (aten.mul.Tensor, 4): "q_norm",
                       (aten.cat.default, 2): "rope", (aten.cat.default, 4): "rope",
                       (aten.mul.Tensor, 16): "kv_norm", (aten.add.Tensor, 3): "out_proj_add",
                       (aten.mul.Tensor, 18): "norm2"}  # fmt: skip
    else:
        elementwise = {(aten.mul.Tensor, 2): "norm1", (aten.cat.default, 1): "rope",
                       (aten.cat.default, 2): "rope", (aten.add.Tensor, 3): "out_proj_add",
                       (aten.mul.Tensor, 14): "norm2"}  # fmt: skip
    meta = defaultdict(int)

    def policy_fn(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        save = False
        if func in (aten.mul.Tensor, aten.cat.default, aten.add.Tensor):
            meta[mode, func] += 1
            save = elementwise.get((func, meta[mode, func])) in policy.names
        elif func == aten.mm.default:
            meta[mode + "_all"] += 1
            unit = matmuls[meta[mode + "_all"] - 1]
            if unit.name in FORCE_RECOMPUTED:  # torchtitan: re-run, not counted
                save = unit.name in policy.names
            else:
                meta[mode] += 1
                save = policy.keeps(unit, meta[mode])
        elif func == aten._grouped_mm.default:
            meta[mode + "_grouped"] += 1
            save = grouped[meta[mode + "_grouped"] - 1].name in policy.names
        elif func in attention_ops:
            save = "attention" in policy.names
        elif func == aten._to_copy.default and kwargs.get("dtype") == torch.float32:
            source = args[0]
            save = source.dim() == 2 and source.shape[-1] == s.hidden
            save = save and source.dtype != torch.float32 and "weighting_inputs" in policy.names
        elif func == aten.index.Tensor and args[0].dim() == 1:
            save = args[0].dtype == torch.float32 and "weighting_inputs" in policy.names
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


@pytest.mark.parametrize(
    ("mla", "policy_text"),
    [
        (True, "sac"),
        (True, "sac:q_down,q_up,kv_up,attention,expert_gate,expert_fc2"),
        (True, "sac:matmuls,expert_up,shared_fc2"),
        (False, "sac"),
        (False, "sac:attention,router,expert_gate,expert_up,expert_fc2"),
        # the element-wise units
        (True, "sac:norm1,q_norm,kv_norm,rope,attention,out_proj_add,norm2,expert_gate"),
        (True, "sac:q_down,kv_down,rope,kv_up,attention,out_proj_add,expert_up"),
        (False, "sac:norm1,rope,v_proj,attention,out_proj_add,norm2,expert_gate"),
    ],
)
def test_torch_selective_checkpoint_keeps_the_predicted_bytes(mla, policy_text):
    """What create_selective_checkpoint_contexts caches under the policy is, with the layer
    input, ckplan's tape (`policy_tape_bytes`), byte for byte; the gradients are the plain
    step's."""
    _check_cached_bytes(mla, policy_text, "float32")


@pytest.mark.parametrize(
    ("mla", "policy_text"),
    [
        (False, "sac:attention,expert_gate,expert_up,weighting_inputs"),
        (False, "sac:matmuls,attention,expert_fc2,weighting_inputs"),
        (True, "sac:matmuls,attention,expert_gate,expert_up,weighting_inputs"),
        (True, "sac:q_up,kv_up,attention,weighting_inputs"),
        (False, "sac:matmuls,attention,expert_gate,expert_up"),
    ],
)
def test_kept_weighting_inputs_are_the_combines_saved_tensors(mla, policy_text):
    """In bf16, as torchtitan's experts run: keeping `weighting_inputs` caches the fp32 copy of
    the experts' outputs and the gathered scores the combine's product saves, 4·S·(h + 1)
    bytes, without the combine's output; the tape is ckplan's byte for byte and the gradients
    are the plain step's."""
    _check_cached_bytes(mla, policy_text, "bfloat16")
    s = spec(mla, dtype_bytes=2)
    policy = parse_policy(policy_text)
    without = parse_policy(policy_text.replace(",weighting_inputs", ""))
    rows = s.seq * s.micro_batch * s.top_k  # S = T·k, dropless, no expert parallelism
    kept = "weighting_inputs" in policy.names
    added = policy_tape_bytes(s, policy) - policy_tape_bytes(s, without)
    assert added == kept * 4 * rows * (s.hidden + 1)


def _check_cached_bytes(mla, policy_text, dtype_name):
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    dtype = getattr(torch, dtype_name)
    s = spec(mla, dtype_bytes=torch.tensor([], dtype=dtype).element_size())
    policy = parse_policy(policy_text)
    torch.manual_seed(0)
    block = _torch_block(torch, s).to(dtype)
    x = torch.randn(s.micro_batch, s.seq, s.hidden, dtype=dtype, requires_grad=True)
    weights = torch.randn(s.micro_batch, s.seq, s.hidden, dtype=dtype)
    modes = []

    def context_fn():
        pair = create_selective_checkpoint_contexts(_policy_fn(torch, s, policy))
        modes.append(pair[0])
        return pair

    out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    storages = {}
    for entries in modes[0].storage.values():
        for wrapped in entries.values():
            for value in wrapped if isinstance(wrapped, tuple) else (wrapped,):
                tensor = getattr(value, "val", None)
                if isinstance(tensor, torch.Tensor):
                    storages[tensor.untyped_storage().data_ptr()] = (
                        tensor.untyped_storage().nbytes()
                    )
    layer_input = x.numel() * x.element_size()
    assert sum(storages.values()) + layer_input == policy_tape_bytes(s, policy)
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    (block(x) * weights).sum().backward()
    for got, want in zip(grads, [p.grad for p in block.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)


# ---- the best per-op policy beside Megatron-Core's modules --------------------------------------


def _usual_layouts():
    """The usual layouts, as validation/policy_table.py prints the docs' table at them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "validation" / "policy_table.py"
    module_spec = importlib.util.spec_from_file_location("policy_table", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.LAYOUTS


LAYOUTS = _usual_layouts()


def _rerun_seconds(s, gpu, groups, kind=None):
    """One stored layer's re-run under `groups`: the re-run ops' forward and collectives."""
    from ckplan.hardware.step_time import layer_time

    time = layer_time(s, gpu, kind, groups)
    return time.core_forward.total + time.core_comm


MODULE_WORDS = ("selective", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")


@pytest.mark.parametrize(
    ("kernels", "framework"),
    [("compiled", "torchtitan"), ("eager", "torchtitan"), ("eager", "deepspeed")],
)
@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_best_policy_dominates_every_module_set(spec_of, model, kernels, framework):
    """At the usual layouts on H100s, for every combination of Megatron-Core's recompute modules
    the model accepts and every kind of layer it has (DeepSeek-V3: its dense first layers and
    its MoE layers): the cheapest per-op policy, layer-level or scoped
    (`policy_search.scoped_frontier`), whose stored bytes per layer are at most the set's
    re-runs no longer than the set. Sets that recompute nothing in a kind of layer are the
    plain tape there and are skipped. Compiled (torchtitan): layer-level policies suffice.
    Eager: every pair, layer-level policies replaying as the framework's checkpoint does
    (torchtitan's without early stop, DeepSpeed's and Hugging Face's with it) and scoped ones
    as the torch export's checkpoints do, with PyTorch's default early stop (`replays`), on
    torchtitan too, whose blocks run them through that snippet
    (tests/test_torchtitan_scoped.py). Eagerly also among the policies the torch export runs
    (`_runnable`), the best of them by its re-run time. On MLA layers within one RoPE re-run
    (`rope_moved_bytes`): to give the attention V the policy keeps kv_up's whole output where
    the module's core keeps V alone, and the op table's module times charge no RoPE rotation.
    On torchtitan's MoE layers a set holds the inputs of the combine's fp32 product without
    the combine's output, as a policy keeping `weighting_inputs` does: compiled, no exception."""
    from itertools import combinations

    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.layers import distinct_kinds
    from ckplan.model.memory import selective_activation_bytes_per_layer
    from ckplan.model.op_policy import replays, unit_ops
    from ckplan.plan.policy_search import best_policy, unit_cost
    from ckplan.plan.strategies import StrategyError, parse_strategy

    gpu = load_gpu("h100-sxm")
    layout = dict(LAYOUTS[model])
    if framework == "deepspeed":  # ZeRO 1 beside pipeline parallelism; no byte of a layer moves
        layout["zero"] = 1 if layout.get("pp", 1) > 1 else layout["zero"]
    s = spec_of(model, framework=framework, kernels=kernels, **layout)
    mode = replays(s)
    if kernels == "compiled":
        assert mode == "graph"
    else:
        assert mode == ("whole" if framework == "torchtitan" else "early_stop")
    checked, lost = 0, []
    for kind in distinct_kinds(s):
        (rope,) = [unit for unit in unit_ops(s, kind) if unit.name == "rope"]
        runnable = _runnable(s, gpu, kind) if kernels == "eager" else ()
        for size in range(1, len(MODULE_WORDS) + 1):
            for words in combinations(MODULE_WORDS, size):
                try:
                    groups = parse_strategy("+".join(words), s).groups
                except StrategyError:
                    continue
                seconds = _rerun_seconds(s, gpu, groups, kind)
                if seconds == 0:
                    continue
                stored = selective_activation_bytes_per_layer(s, groups, kind)
                best = best_policy(s, stored, gpu, kind, scoped=True)
                assert best.tape_bytes <= stored, words
                policy = (best.strategy,)
                assert selective_activation_bytes_per_layer(s, policy, kind) == best.tape_bytes
                slack = unit_cost(s, rope, gpu, kind) if s.mla else 0.0
                got = _rerun_seconds(s, gpu, policy, kind)
                checked += 1
                if got > seconds * (1 + 1e-12) + slack:
                    lost.append((kind.moe, words))
                if kernels == "eager":
                    fitting = [p for p in runnable if p.tape_bytes <= stored]
                    fastest = min(_rerun_seconds(s, gpu, (p.strategy,), kind) for p in fitting)
                    if fastest > seconds * (1 + 1e-12) + slack:
                        lost.append(("runnable", kind.moe, words))
    assert checked >= {"llama3-8b": 7, "mixtral-8x7b": 11, "deepseek-v3": 153}[model]
    assert lost == [], lost


def _runnable(spec, gpu, kind):
    """The frontier's policies `export --to torch` runs on `spec`'s layers of `kind`: layer-level
    ones whose kept units a policy_fn recognises by their aten op (`op_policy.op_recognised`;
    modelled with the framework's replay, which re-runs no less than the snippet's early stop),
    and scoped ones whose regions are submodules (`scoped_frontier(wrapped=True)`)."""
    from ckplan.model.op_policy import op_recognised
    from ckplan.plan.policy_search import policy_frontier, scoped_frontier

    layer = [
        point
        for point in policy_frontier(spec, gpu, kind)
        if not point.strategy.startswith("sac")
        or all(op_recognised(spec, n) for n in kept_units(spec, parse_policy(point.strategy), kind))
    ]
    return (*layer, *scoped_frontier(spec, gpu, kind, wrapped=True))


@pytest.mark.parametrize(
    ("mla", "strategy"),
    [
        (True, "sac"),
        (True, "sac:q_up,attention,expert_gate,expert_fc2"),
        (False, "sac:matmuls,expert_up"),
    ],
)
def test_exported_policy_fn_keeps_the_predicted_bytes(mla, strategy):
    """The torch export's policy_fn (aten.mm and aten._grouped_mm by their count, the SDPA
    kernels) on the torchtitan-style blocks: what its checkpoints keep is ckplan's tape, and the
    gradients are the plain step's."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    import torch.utils.checkpoint as checkpoint_module

    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy

    s = spec(mla, vocab=128)
    plan = evaluate(s, parse_strategy(strategy, s))
    namespace, modes = recording_snippet(plan)
    torch.manual_seed(0)
    block = _torch_block(torch, s)
    x = torch.randn(s.micro_batch, s.seq, s.hidden, requires_grad=True)
    weights = torch.randn(s.micro_batch, s.seq, s.hidden)
    out = checkpoint_module.checkpoint(
        block, x, use_reentrant=False, context_fn=namespace["context_fn"]
    )
    kept = {
        tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
        for entries in modes[0].storage.values()
        for wrapped in entries.values()
        for value in (wrapped if isinstance(wrapped, tuple) else (wrapped,))
        if isinstance(tensor := getattr(value, "val", None), torch.Tensor)
    }
    policy = parse_policy(strategy)
    assert sum(kept.values()) + x.numel() * x.element_size() == policy_tape_bytes(s, policy)
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    (block(x) * weights).sum().backward()
    for got, want in zip(grads, [p.grad for p in block.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)


def test_mla_rope_unit_moves_the_rotation_and_the_assembly():
    """MLA's rope unit (`rope_moved_bytes`): RoPE on q_pe (4 heads) and the shared k_pe, 8 dims
    each, read and written; cat([q_nope, q_pe]) reads and writes Q; cat([k_nope, k_pe]) reads
    K's 8 no-RoPE dims per head and the shared key and writes K (32 tokens, 4 bytes)."""
    from ckplan.model.op import LayerShapes
    from ckplan.model.op_policy import MLA_ROPE, rope_moved_bytes, unit_ops

    s = spec(True)
    (rope,) = [unit for unit in unit_ops(s) if unit.name == "rope"]
    q = k = 4 * 32 * 4 * 16
    hand = 2 * 4 * 32 * 5 * 8 + 2 * q + (4 * 32 * 4 * 8 + 4 * 32 * 8) + k
    assert rope.op.forward_bytes == rope_moved_bytes(s, LayerShapes.of(s)) == hand == 39_936
    assert rope.op.name == MLA_ROPE


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize(
    "pipeline",
    [
        {"pp": 2},
        {"pp": 2, "virtual_stages": 2, "microbatches": 4},
        {"pp": 2, "first_stage_layers": 1, "last_stage_layers": 3},
        {"pp": 2, "cp": 2, "ep": 2, "dp": 2, "zero": 3},
    ],
)
def test_a_layers_scoped_frontier_is_the_same_on_every_pipeline(mla, pipeline):
    """`plan` computes the scoped frontier once per layer shape (`search._one_stage`): a layout's
    pipeline keys change neither what a layer keeps nor what its re-runs cost, so the frontier
    of the layout is the one-stage frontier, point for point."""
    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.layers import layer_kinds
    from ckplan.plan.policy_search import scoped_frontier
    from ckplan.plan.search import _one_stage

    gpu = load_gpu("h100-sxm")
    s = spec(mla, layers=4, moe_layers="1-", **pipeline)  # a dense layer and MoE ones
    one = _one_stage(s)
    assert one.pp == 1 and (one.tp, one.cp, one.ep, one.micro_batch) == (s.tp, s.cp, s.ep, 2)
    kinds = tuple(dict.fromkeys(layer_kinds(s)))
    assert len(kinds) == 2
    for kind in (*kinds, None):
        frontier = scoped_frontier(s, gpu, kind, wrapped=True)
        assert len(frontier) > 1 and frontier == scoped_frontier(one, gpu, kind, wrapped=True)
