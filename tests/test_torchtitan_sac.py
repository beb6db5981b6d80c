"""torchtitan 0.3.0's own Llama 3 block under its own `SelectiveAC` (torchtitan/distributed/
activation_checkpoint.py and torchtitan/models/llama3/__init__.py in the wheel
torchtitan-0.3.0-py3-none-any.whl), run on the CPU: the bytes the selective checkpoint keeps,
against ckplan's per-op policies, and the gradients of the block without checkpointing.

0.3.0 builds every Llama 3 flavour with `fuse_qkv=True` (`_build_llama3_layers`): one `wqkv`
GEMM (`FusedQKVLinear`, torchtitan/models/common/attention.py) instead of 0.2.2's wq, wk, wv.
The every-second-mm rule then counts wqkv, wo, w1, w3, w2 and keeps wqkv (Q, K and V in one
storage), w1 and w2: ckplan's `sac` (0.2.2's wq, wk, wv, wo, w1, w3, w2: keeps Q and V) plus the
K projection. The language models attend with FlexAttention, compiled, which has no CPU
backward ("FlexAttention does not support backward on CPU", torch 2.13; inductor's CPU lowering
fails on its training graph). The first test runs torchtitan's own `ScaledDotProductAttention`
in its place: on the CPU that is `aten._scaled_dot_product_flash_attention_for_cpu`, which
SelectiveAC does not save, so the measured tape is the matmul rule's alone, compared with
ckplan's policy without `attention`.

The second runs FlexAttention, compiled with AOTAutograd's min-cut partition (the partition
inductor uses, torch/_functorch/partitioners.py), its forward graph run eagerly inside the
`inductor_compiled_code` operator as inductor wraps compiled code under a dispatch mode when
`wrap_inductor_compiled_regions` is set (torch/_inductor/output_code.py, `post_compile`), which
FlexAttention's `inductor_configs` set. The forward graph returns the attention output, its
logsumexp and the inputs its backward reads, the rotated Q and K and V (a contiguous copy out
of wqkv's output); SelectiveAC saves all of them. ckplan's `sac-fused` models both (the
wqkv counted once, FlexAttention's region with V's copy): its tape is the measured bytes.
"""

import pytest
from export_snippet import cached_storages
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip
from test_op_policy import SMALL as OP_POLICY_SMALL

from ckplan.model.op import LayerShapes
from ckplan.model.op_policy import flex_region_copy_bytes, parse_policy, policy_tape_bytes
from ckplan.model.spec import spec_from_mapping

# ckplan's small torchtitan-style block (tests/test_op_policy.py), one layer
SMALL = {**OP_POLICY_SMALL, "layers": 1}
# torchtitan 0.3.0's mm rule on its fused-QKV Llama 3 block, attention not saved (CPU SDPA)
FUSED_QKV_MATMULS = "sac:matmuls%2,k_proj"
# torchtitan 0.2.2's mm rule (ckplan's `sac` without the attention kernel and collectives)
SEPARATE_QKV_MATMULS = "sac:matmuls%2"


def _one_layer_configs(spec):
    """torchtitan 0.3.0's layer configs of a one-block Llama 3 at `spec`'s shape, FlexAttention."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers

    return _build_llama3_layers(
        n_layers=1,
        dim=spec.hidden,
        n_heads=spec.heads,
        n_kv_heads=spec.kv_heads,
        hidden_dim=spec.ffn_hidden,
        rope=ComplexRoPE.Config(
            dim=spec.hidden // spec.heads, max_seq_len=spec.seq, theta=500000, scaling="none"
        ),
        attn_backend="flex",
    )


def _block(torch, spec):
    """torchtitan 0.3.0's Llama 3 block for `spec`, its inner attention torchtitan's SDPA."""
    framework_or_skip("torchtitan", "torchtitan 0.3.0's SelectiveAC not measured")
    from torchtitan.models.common.attention import ScaledDotProductAttention

    (config,) = _one_layer_configs(spec)
    config.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    block = config.build()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return block


def _checkpointed(torch, block, policy_class, monkeypatch):
    """`block` wrapped by torchtitan's `policy_class` (its `apply`, as parallelize_llama calls
    it), and the selective-checkpoint caching modes it creates, in order."""
    import torchtitan.distributed.activation_checkpoint as ac

    modes = []
    create = ac.create_selective_checkpoint_contexts

    def recording(policy_fn, *args, **kwargs):
        pair = create(policy_fn, *args, **kwargs)
        modes.append(pair[0])
        return pair

    monkeypatch.setattr(ac, "create_selective_checkpoint_contexts", recording)

    class Model(torch.nn.Module):  # what `apply` reads: the blocks under `layers`
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": block})

    model = Model()
    policy_class(policy_class.Config()).apply(model)
    return model.layers["0"], modes


def _cached_bytes(torch, mode, leave_out=frozenset()) -> int:
    """Bytes of the distinct storages a selective checkpoint's cache holds, but those whose
    data pointers are in `leave_out`."""
    storages = cached_storages(torch, [mode])
    return sum(size for pointer, size in storages.items() if pointer not in leave_out)


def _assert_plain_gradients(torch, block, wrapped, x, out, masks=None, positions=None):
    out.sum().backward()
    got = [p.grad.clone() for p in wrapped.parameters()] + [x.grad.clone()]
    plain_x = x.detach().clone().requires_grad_(True)
    block.zero_grad()
    block(plain_x, masks, positions).sum().backward()
    want = [p.grad for p in block.parameters()] + [plain_x.grad]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_selective_ac_keeps_the_fused_qkv_output_w1_and_w2(monkeypatch):
    torch = torch_or_skip()
    spec = spec_from_mapping(SMALL)
    block = _block(torch, spec)
    import copy

    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    wrapped, modes = _checkpointed(torch, copy.deepcopy(block), SelectiveAC, monkeypatch)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    out = wrapped(x, None, None)
    (mode,) = modes
    measured = x.numel() * x.element_size() + _cached_bytes(torch, mode)
    # x 32·64·4, wqkv 32·(64+32+32)·4, w1 32·96·4, w2 32·64·4
    assert measured == policy_tape_bytes(spec, parse_policy(FUSED_QKV_MATMULS)) == 45_056
    # the fused count, written as sac-fused's item: wqkv counted once, kept whole
    assert measured == policy_tape_bytes(spec, parse_policy("sac:fused_qkv,matmuls%2"))
    # 0.2.2's rule (wq, wv, w1, w2) keeps 4096 bytes less: K's 32·32·4
    assert measured - policy_tape_bytes(spec, parse_policy(SEPARATE_QKV_MATMULS)) == 4096
    _assert_plain_gradients(torch, block, wrapped, x, out)


def _llama3_block(torch, spec, dtype):
    """torchtitan 0.3.0's Llama 3 model of one block with FlexAttention, built by its own
    config classes at `spec`'s shape in `dtype`: (the block, its block mask, the positions)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model

    layers = _one_layer_configs(spec)
    vocab = 128
    config = Llama3Model.Config(
        dim=spec.hidden,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=spec.hidden),
        norm=RMSNorm.Config(normalized_shape=spec.hidden),
        lm_head=Linear.Config(in_features=spec.hidden, out_features=vocab),
        layers=layers,
    )
    torch.manual_seed(0)
    model = config.build()
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    model = model.to(dtype)
    positions = torch.arange(spec.seq).repeat(spec.micro_batch, 1)
    return model.layers["0"], model.get_attention_masks(positions), positions


def _flex_block(torch, spec, monkeypatch, dtype):
    """torchtitan 0.3.0's Llama 3 block with its FlexAttention, compiled as described above,
    and the block mask and positions of `spec`'s micro-batch (one document per sequence)."""
    framework_or_skip("torchtitan", "torchtitan 0.3.0's SelectiveAC not measured")
    import torch.nn.attention.flex_attention as flex
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._higher_order_ops.wrap import InductorCompiledCallable, inductor_compiled_code
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode
    from torchtitan.models.common.attention import FlexAttention

    def forward_compiler(graph, inputs):
        boxed = make_boxed_func(graph)
        region = InductorCompiledCallable(boxed, graph)

        def call(args):
            if is_in_torch_dispatch_mode():
                return inductor_compiled_code(region, args)
            return boxed(args)

        call._boxed_call = True
        return call

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda graph, inputs: make_boxed_func(graph),
        partition_fn=min_cut_rematerialization_partition,
    )
    monkeypatch.setattr(flex, "_validate_device", lambda *args, **kwargs: None)
    torch._dynamo.reset()
    monkeypatch.setattr(
        FlexAttention, "_compiled_flex_attn", torch.compile(flex.flex_attention, backend=backend)
    )
    return _llama3_block(torch, spec, dtype)


@pytest.mark.parametrize(
    ("dtype", "size", "hand", "more"),
    [("float32", 4, 70_144, 20_480), ("bfloat16", 2, 35_328, 10_240)],
)
def test_selective_ac_saves_flex_attention_with_its_inputs(monkeypatch, dtype, size, hand, more):
    torch = torch_or_skip()
    spec = spec_from_mapping({**SMALL, "dtype_bytes": size})
    block, masks, positions = _flex_block(torch, spec, monkeypatch, getattr(torch, dtype))
    import copy

    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    wrapped, modes = _checkpointed(torch, copy.deepcopy(block), SelectiveAC, monkeypatch)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, dtype=getattr(torch, dtype))
    x.requires_grad_(True)
    out = wrapped(x, masks, positions)
    (mode,) = modes
    # the block mask's tensors and the document ends its mask function captured are the
    # step's, one set for every layer: not the layer's tape
    shared = {
        t.untyped_storage().data_ptr() for t in _tensors(torch, [masks.as_tuple(), masks.mask_mod])
    }
    kept = _cached_bytes(torch, mode, leave_out=shared)
    measured = x.numel() * x.element_size() + kept
    # ckplan's units: wqkv (q, k, v), the rotated Q and K (`rope`), the attention output and
    # its fp32 logsumexp, w1, w2, and V's copy, which no ckplan unit names (32·32·size)
    head_dim = spec.hidden // spec.heads
    v_copy = spec.dtype_bytes * spec.micro_batch * spec.seq * spec.kv_heads * head_dim
    modelled = policy_tape_bytes(spec, parse_policy(FUSED_QKV_MATMULS + ",rope,attention"))
    assert measured == modelled + v_copy == hand
    # ckplan's sac-fused, torchtitan 0.3.0's SelectiveAC: the same units and V's copy
    fused = parse_policy("sac-fused")
    assert flex_region_copy_bytes(spec, fused) == v_copy
    assert policy_tape_bytes(spec, fused) == measured
    # ckplan's sac (0.2.2's op SAC: wq, wv, attention, w1, w2) keeps less: K, the rotated Q
    # and K, V's copy (32·(32 + 64 + 32 + 32)·size)
    assert measured - policy_tape_bytes(spec, parse_policy("sac")) == more
    _assert_plain_gradients(torch, block, wrapped, x, out, masks, positions)
    torch._dynamo.reset()


def _tensors(torch, values):
    """The tensors among `values` and inside the tuples, lists and closures of the callables
    among them (a mask function's captured document ends)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _tensors(torch, value)
        elif callable(value) and getattr(value, "__closure__", None):
            found += _tensors(torch, [cell.cell_contents for cell in value.__closure__])
    return found


def _compiled_llama3_block(torch, spec, monkeypatch, dtype):
    """torchtitan 0.3.0's Llama 3 block with its FlexAttention as the model builds it (no
    region of its own: the whole block is compiled), its block mask and positions."""
    framework_or_skip("torchtitan", "torchtitan 0.3.0's SelectiveAC not measured")
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args, **kwargs: None)
    return _llama3_block(torch, spec, dtype)


def _compile_saved(torch, module, x, masks, positions):
    """`module` compiled as torchtitan's `apply_compile` compiles a block (fullgraph), with
    AOTAutograd's min-cut partition and Inductor's decompositions (the graphs Inductor would
    lower; its CPU lowering of FlexAttention's backward fails): the output, the gradients of
    the parameters and of `x` after `out.sum().backward()`, and (node, bytes) of the
    activations the partitioned forward graph saves for backward (its inputs left out)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def forward(gm, _):
        graphs["forward"] = gm
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    out = torch.compile(module, backend=backend, fullgraph=True)(x, masks, positions)
    out.sum().backward()
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    (output,) = [node for node in graphs["forward"].graph.nodes if node.op == "output"]
    saved = []
    for node in output.args[0][1:]:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and node.op != "placeholder":
            saved.append((str(node.target), value.numel() * value.element_size()))
    torch._dynamo.reset()
    return grads, saved


@pytest.mark.parametrize(
    ("dtype", "size", "hand"), [("float32", 4, 45_568), ("bfloat16", 2, 23_040)]
)
def test_compiled_selective_ac_saves_flex_attention_outputs_not_its_inputs(
    monkeypatch, dtype, size, hand
):
    """`kernels: compiled`: torchtitan compiles each block after SelectiveAC wraps it
    (`apply_compile`), so the policy tags the block graph's ops, FlexAttention among them as
    the `flex_attention` operator. The partitioned forward saves the block input, wqkv's output
    (Q, K and V), FlexAttention's output and fp32 logsumexp and w1's output: not the rotated Q
    and K (RoPE re-runs from wqkv's output), not V's copy (a view of it), not w2's output (no
    backward reads it). The gradients are those of the block compiled without checkpointing."""
    torch = torch_or_skip()
    spec = spec_from_mapping({**SMALL, "dtype_bytes": size, "bias": False, "kernels": "compiled"})
    kind = getattr(torch, dtype)
    block, masks, positions = _compiled_llama3_block(torch, spec, monkeypatch, kind)
    import copy

    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    wrapped, _ = _checkpointed(torch, copy.deepcopy(block), SelectiveAC, monkeypatch)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, dtype=getattr(torch, dtype))
    got, saved = _compile_saved(torch, wrapped, x.clone().requires_grad_(True), masks, positions)
    X = x.numel() * x.element_size()
    # x 32·64, wqkv 32·128, the output 32·64 and logsumexp 4·32 (fp32), w1 32·96
    assert X + sum(nbytes for _, nbytes in saved) == hand
    assert sorted(nbytes for _, nbytes in saved) == sorted(
        [32 * 128 * size, 32 * 64 * size, 4 * 32 * 4, 32 * 96 * size]
    )
    fused = parse_policy("sac-fused")
    assert policy_tape_bytes(spec, fused) == hand
    assert flex_region_copy_bytes(spec, fused) == 0
    want, _ = _compile_saved(torch, block, x.clone().requires_grad_(True), masks, positions)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_full_ac_keeps_the_input_and_gives_the_plain_gradients(monkeypatch):
    torch = torch_or_skip()
    spec = spec_from_mapping(SMALL)
    block = _block(torch, spec)
    import copy

    from torchtitan.distributed.activation_checkpoint import FullAC

    wrapped, modes = _checkpointed(torch, copy.deepcopy(block), FullAC, monkeypatch)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    packed = []

    def pack(tensor):
        packed.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = wrapped(x, None, None)
    # checkpoint_wrapper (non-reentrant) saves the block's input and nothing else, and creates
    # no selective cache: ckplan's `full` layer holds the residual stream X
    assert modes == [] and [t.untyped_storage().data_ptr() for t in packed] == [x.data_ptr()]
    assert packed[0].untyped_storage().nbytes() == LayerShapes.of(spec).X == 8192
    _assert_plain_gradients(torch, block, wrapped, x, out)
