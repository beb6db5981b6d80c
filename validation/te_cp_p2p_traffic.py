"""The bytes Transformer Engine's point-to-point context parallelism moves beside its kernel
calls, counted on the CPU: the count behind ckplan's `context_parallel.TE_CP_MOVED`
(docs/time-model.md), release by release.

Megatron-Core and NeMo run context parallelism (cp > 1, `cp_comm_type` p2p, the default)
through Transformer Engine's `AttnFuncWithCP` (TE v1.8, transformer_engine/pytorch/
attention.py), later `AttnFuncWithCPAndKVP2P`. The class needs CUDA to import, so this script
takes the class's own text from a TE source file, runs it on CPU tensors with the counting of
validation/torch_cp_ring_traffic.py: a stand-in for the fused-attention kernel that makes its
outputs with the counting off, no-op streams and events, the K/V point-to-point exchange not
counted (it is the network's), and a TorchDispatchMode adding up the bytes of every op's
tensor inputs and outputs but views and allocations (`empty_like`), a copy's or fill's
destination written and not read, `zeros_like` writing its output and reading nothing. The
functions TE compiles (`@jit_fuser`, torch.compile from PyTorch 2 on: the output and logsumexp
corrections) are counted as the one kernel each compiles to: the arguments they read and the
ones they write, nothing in between.

Q, K, V and the output gradient are bf16 (s, b, a, d) tensors (Megatron's sbhd layout),
causal, the cuDNN fused-attention path (`use_fused_attention`), no bias, no dropout; K and V at
the query heads and at half of them, and two head sizes, separate the Q-, K/V- and
logsumexp-sized terms (the rank's chunk: s tokens). Printed per cp: the mean over the ranks
beside ckplan's. With --memory the most bytes the backward holds at once beyond what it is
handed and saved, and the most at a kernel call, on its busiest rank
(`backward_live`), beside `te_p2p_backward_live_bytes` (the peak with the dQ, dK, dV it
returns). The stand-ins are the kernels' and the exchange's; every other name TE's text
uses but does not define must have one, or the run stops (`STUBBED` lists the few left as
inert stubs), so that no path runs on a stub unnoticed.

With --comm=a2a the same for the all-to-all context parallelism (`cp_comm_type` a2a,
`AttnFuncWithCPAndQKVOA2A`, v1.11 on; the all-to-alls are the network's, uncounted), beside
`context_parallel.te_a2a_moved_bytes`; with --memory, the most bytes its backward holds at
once beyond what it is handed and saved (`backward_live`), beside
`te_a2a_backward_workspace_bytes` plus the kernel's dQ, dK, dV. The all-to-alls split the heads,
so those runs skip the cp that does not divide them. With --comm=allgather the all-gather
context parallelism (`cp_comm_type` all_gather, `AttnFuncWithCPAndKVAllGather`, v1.10 on; the
gathers and reduce-scatters uncounted), beside `te_allgather_moved_bytes`, and with --memory
its backward's most live bytes, at a kernel call and at all, on its busiest rank, beside
`te_allgather_backward_live_bytes`. With --comm=a2a+p2p the point-to-point class given two
groups (`cp_comm_type` a2a+p2p, v1.12 on: all-to-alls over A2A_SIZE ranks, the ring over
cp / A2A_SIZE), beside `te_p2p_moved_bytes` at the ring's size plus
`te_hierarchical_a2a_moved_bytes`, and with --memory its backward beside
`te_hierarchical_backward_workspace_bytes` around the ring's `te_p2p_backward_live_bytes`.

With --mla (p2p or a2a+p2p, v2.5 on) MLA's attention: Q and K at one head size, V and the
output at a smaller one (MLA_SHAPES), K/V at the query heads, the class's `enable_mla` path,
beside `te_p2p_mla_moved_bytes` and `te_p2p_mla_backward_live_bytes`.

Usage (the release's source file, or PyPI's pure-Python `transformer_engine` wheel of it,
v1.10 on; the release as ckplan's `framework_version`):
    git -C TransformerEngine show v1.8:transformer_engine/pytorch/attention.py > te.py
    python validation/te_cp_p2p_traffic.py te.py te1.8 [--memory] [--check]
    pip download --no-deps -d wheels transformer_engine==2.9.0
    python validation/te_cp_p2p_traffic.py wheels/transformer_engine-2.9.0-py3-none-any.whl te2.9
    python validation/te_cp_p2p_traffic.py te.py te2.9 --comm=a2a [--memory] [--check]
    python validation/te_cp_p2p_traffic.py te.py te2.9 --comm=allgather [--memory] [--check]
    python validation/te_cp_p2p_traffic.py te.py te2.9 --comm=a2a+p2p [--memory] [--check]
    python validation/te_cp_p2p_traffic.py te.py te2.9 --mla [--comm=a2a+p2p] [--memory]
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import math
import sys
import types
import zipfile

SHAPES = ({"b": 1, "a": 8, "s": 16, "d": 32}, {"b": 1, "a": 8, "s": 16, "d": 64})
CPS = (2, 3, 4, 8)
# MLA: Q's and K's head size d, V's and the output's dv; three pairs separate the Q-, V- and
# logsumexp-sized terms
MLA_SHAPES = (
    {"b": 1, "a": 8, "s": 16, "d": 48, "dv": 32},
    {"b": 1, "a": 8, "s": 16, "d": 64, "dv": 32},
    {"b": 1, "a": 8, "s": 16, "d": 64, "dv": 16},
)
# the autograd function of each `cp_comm_type`: p2p (`AttnFuncWithCP` in v1.8-1.9), a2a (v1.11 on)
CLASS_NAMES = {
    "p2p": ("AttnFuncWithCP", "AttnFuncWithCPAndKVP2P"),
    "a2a": ("AttnFuncWithCPAndQKVOA2A",),
    "allgather": ("AttnFuncWithCPAndKVAllGather",),
    "a2a+p2p": ("AttnFuncWithCPAndKVP2P",),
}
# the all-to-all group's size under --comm=a2a+p2p (the ring's: cp / A2A_SIZE)
A2A_SIZE = 2
MODULE_PATHS = (
    "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py",
    "transformer_engine/pytorch/attention.py",
)
NOT_COUNTED = {
    "view", "_unsafe_view", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
    "slice", "select", "chunk", "split", "split_with_sizes", "unbind", "alias", "as_strided",
    "detach", "movedim", "unsqueeze_", "squeeze_", "_reshape_alias", "reshape",
}  # fmt: skip
# ops that write their first argument without reading it
OVERWRITES = {"copy_", "fill_", "zero_"}
# allocations: no kernel touches the memory
ALLOCATES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# factories shaped like their argument: a fill kernel writes the output, reading nothing
FILLS_LIKE = {"zeros_like", "ones_like", "full_like"}


class _Counter:
    """Bytes moved by the counted ops, and whether counting is paused (kernels, compiled
    functions, the exchange)."""

    def __init__(self):
        self.bytes = 0
        self.paused = False

    @contextlib.contextmanager
    def pause(self):
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


def _nbytes(tensor) -> int:
    """A tensor's bytes; none for integer tensors (the cumulative sequence lengths and the
    random-number state, a few bytes each)."""
    if not tensor.is_floating_point():
        return 0
    return tensor.numel() * tensor.element_size()


def load(source: str, names: dict, comm: str = "p2p") -> type:
    """TE's context-parallel autograd function for `comm` and the functions beside it, from
    the text of the module that defines it, with `names` (CPU stand-ins) for what it imports."""
    code, name = _compiled(source, frozenset(names), CLASS_NAMES[comm])
    namespace = _Namespace(names)
    exec(code, namespace)  # TE's own text
    return namespace[name]


@functools.lru_cache(maxsize=8)
def _compiled(source: str, stand_ins: frozenset, classes: tuple) -> tuple:
    """The class (the one of `classes` the text defines), the module's functions but those
    `stand_ins` replace, and its plain constants, compiled; and the class's name."""
    tree = ast.parse(source)
    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.ClassDef) and node.name in classes)
        or (isinstance(node, ast.FunctionDef) and node.name not in stand_ins)
        or (isinstance(node, ast.Assign) and _literal(node.value))
    ]
    name = next((n.name for n in keep if isinstance(n, ast.ClassDef)), None)
    if name is None:
        raise SystemExit(f"the source defines none of {', '.join(classes)}")
    return compile(ast.Module(body=keep, type_ignores=[]), "<te>", "exec"), name


def source_from_wheel(path: str) -> str:
    """The text of TE's context-parallel module from a `transformer_engine` wheel (PyPI's
    pure-Python package, from v1.10; v1.9's holds no PyTorch code): transformer_engine/pytorch/
    attention.py up to v2.2, attention/dot_product_attention/context_parallel.py from v2.3."""
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        for inside in MODULE_PATHS:
            if inside in names:
                return wheel.read(inside).decode("utf-8")
    raise SystemExit(f"{path}: no Transformer Engine PyTorch attention module in the wheel")


def _combined(counter: _Counter):
    """TE's `combine_tensors` (transformer_engine/pytorch/utils.py): dK and dV as one tensor,
    a view of the buffer the kernel wrote them into side by side; the stand-in kernel makes
    them apart, so they are stacked with the counting off."""
    import torch

    def combine_tensors(tensors, dim):
        # TE inserts the new dimension as list.insert(dim, ...) does on the shape
        where = dim if dim >= 0 else tensors[0].dim() + dim
        with counter.pause():
            return torch.stack(tensors, where)

    return combine_tensors


def _no_quantizers(source: str):
    """TE 2.x's `get_attention_quantizers` without FP8: as many Nones as the line calling it
    unpacks (the forward and the backward unpack different sets)."""
    counts = _unpacked_quantizers(source)

    def quantizers(*args, **kwargs):
        return (None,) * counts[sys._getframe(1).f_lineno]

    return quantizers


@functools.lru_cache(maxsize=8)
def _unpacked_quantizers(source: str) -> dict[int, int]:
    """How many names each line assigning `get_attention_quantizers(...)` unpacks, by line."""
    counts = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called = ast.unparse(node.value.func)
            if called.endswith("get_attention_quantizers") and isinstance(
                node.targets[0], ast.Tuple
            ):
                for line in range(node.lineno, node.end_lineno + 1):
                    counts[line] = len(node.targets[0].elts)
    return counts


def _restore_from_saved(objects, saved, return_saved_tensors=False):
    """TE 2.x's `restore_from_saved` for plain tensors: the saved tensors back, in order."""
    restored, rest = list(saved[: len(objects)]), saved[len(objects) :]
    return (restored, rest) if return_saved_tensors else restored


def _literal(node) -> bool:
    """Whether a module-level value is a plain constant or an empty container (TE's caches)."""
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


class _Stub:
    """Anything TE's text names that the run does not need: attribute access and calls give
    more stubs."""

    def __init__(self, name, **attributes):
        self._name = name
        self.__dict__.update(attributes)

    def __getattr__(self, attr):
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        return _Stub(f"{self._name}()")

    def __getitem__(self, key):
        return _Stub(f"{self._name}[{key!r}]")

    def __repr__(self):
        return f"<stub {self._name}>"


# what TE's text names that no bf16, sbhd, fused-attention run reaches but for an enum or a
# recipe object: stubs; any other name it does not define must be given a stand-in
STUBBED = {"tex", "FusedAttnBackend", "FP8GlobalStateManager"}


class _Namespace(dict):
    """exec globals: names TE's text imports, as CPU stand-ins; `STUBBED` names `_Stub`s; any
    other unknown name an error, so that no code path runs on a stub unnoticed."""

    def __missing__(self, key):
        import builtins

        if hasattr(builtins, key):
            return getattr(builtins, key)
        if key.startswith("_flash_attn_"):  # flash-attn version flags: the kernel is a stand-in
            return True
        if key[0].isupper() and "Tensor" in key:  # FP8 tensor classes: no tensor here is one
            self[key] = type(key, (), {})
            return self[key]
        if key in STUBBED:
            return _Stub(key)
        raise KeyError(key)


def _fused_kernel(counter: _Counter):
    """`jit_fuser`: a compiled function runs as one kernel, reading its tensor arguments and
    writing those it mutates (its intermediates stay in registers)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def decorate(function):
        def run(*args, **kwargs):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            read = {id(t): False for t in tensors}
            before = [t._version for t in tensors]

            class Reads(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, op_args=(), op_kwargs=None):
                    name = func.overloadpacket.__name__
                    inputs = tree_leaves((op_args, op_kwargs))
                    if name in OVERWRITES:
                        inputs = inputs[1:]
                    for t in inputs:
                        base = getattr(t, "_base", None)
                        for candidate in (t, base):
                            if id(candidate) in read:
                                read[id(candidate)] = True
                    return func(*op_args, **(op_kwargs or {}))

            with counter.pause(), Reads():
                out = function(*args, **kwargs)
            written = [t for t, v in zip(tensors, before, strict=True) if t._version != v]
            returned = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            counter.bytes += sum(_nbytes(t) for t in tensors if read[id(t)])
            counter.bytes += sum(_nbytes(t) for t in written + returned)
            return out

        return run

    return decorate


class _NoStream:
    """A CUDA stream or event that orders nothing: the CPU runs one op after another."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        pass


@contextlib.contextmanager
def _cpu_cuda():
    """torch.cuda's streams and events as no-ops, so TE's overlap code runs on the CPU."""
    import torch

    saved = {n: getattr(torch.cuda, n) for n in ("stream", "current_stream", "Event", "Stream")}
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a: _NoStream()
    torch.cuda.Event = _NoStream
    torch.cuda.Stream = _NoStream
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


@contextlib.contextmanager
def _patched(module, **attributes):
    """`module`'s attributes replaced while the block runs."""
    saved = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def measure(
    source: str,
    cp: int,
    rank: int,
    shape: dict[str, int],
    kv_heads: int,
    comm: str = "p2p",
    loader=load,
) -> tuple:
    """Bytes TE's context-parallel attention (`cp_comm_type` `comm`) moves on rank `rank` of
    `cp` beside its kernels, (forward, backward); `loader` loads the class (`load`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    counter = _Counter()
    b, a, s, d = (shape[k] for k in "basd")
    # a2a+p2p: the class runs the ring over `ring` ranks (this is ring rank `rank`, all-to-all
    # rank 0) behind all-to-alls over A2A_SIZE; cp_group is the two groups, named
    hierarchical = comm == "a2a+p2p"
    ring = cp // A2A_SIZE if hierarchical else cp
    sizes = {"a2a": A2A_SIZE, "p2p": ring}
    ranks = {"a2a": 0, "p2p": rank}

    class Moved(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if counter.paused or name in NOT_COUNTED or name in ALLOCATES:
                return out
            inputs = tree_leaves((args, kwargs))[1 if name in OVERWRITES else 0 :]
            if name in FILLS_LIKE:
                inputs = []
            tensors = [t for t in inputs + tree_leaves(out) if isinstance(t, torch.Tensor)]
            counter.bytes += sum(_nbytes(t) for t in tensors)
            return out

    def big(values):
        return [t for t in values if isinstance(t, torch.Tensor) and t.dim() >= 3]

    def fused_attn_fwd(*args, **kwargs):
        q, _, v = big(args)[:3]
        with counter.pause():
            out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
            lse = torch.randn(q.shape[1], q.shape[2], q.shape[0], 1, dtype=torch.float32)
            rng = torch.zeros(2, dtype=torch.int64)
        return out, [lse, rng]

    def fused_attn_bwd(*args, **kwargs):
        q, k, v = big(args)[:3]
        with counter.pause():
            grads = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        return (*grads, None)

    def exchange(rank_, send, send_dst, recv, recv_src, group, batch):
        return []

    class _Done:
        def wait(self):
            pass

    def gather_along_first_dim(tensor, group, *args, **kwargs):
        # the network's: cp copies of the rank's tensor, as the gather's output, uncounted
        with counter.pause():
            return torch.cat([tensor] * cp), None

    def reduce_scatter_along_first_dim(tensor, group, *args, **kwargs):
        with counter.pause():
            return tensor[: tensor.shape[0] // cp].clone(), None

    def all_to_all_single(output, input, group=None, async_op=False):
        # the network's: the received chunks land in `output`, uncounted
        with counter.pause():
            output.copy_(input)
        return _Done()

    no_quantizers = _no_quantizers(source)
    names = dict(
        torch=torch,
        os=__import__("os"),
        jit_fuser=_fused_kernel(counter),
        get_distributed_world_size=lambda group: sizes.get(group, cp),
        get_distributed_rank=lambda group: ranks.get(group, rank),
        fused_attn_fwd=fused_attn_fwd,
        fused_attn_bwd=fused_attn_bwd,
        flash_attn_p2p_communicate=exchange,
        TE_DType={torch.bfloat16: "bf16"},
        # TE 2.x: no FP8 here, so every quantizer is None; tensors saved as they are
        get_attention_quantizers=no_quantizers,
        dpa_utils=_Stub(
            "dpa_utils",
            get_attention_quantizers=no_quantizers,
            get_full_cu_seqlens=lambda batch, length, device: torch.arange(
                0, (batch + 1) * length, length, dtype=torch.int32
            ),
        ),
        gather_along_first_dim=gather_along_first_dim,
        reduce_scatter_along_first_dim=reduce_scatter_along_first_dim,
        prepare_for_saving=lambda *tensors: (list(tensors), [None] * len(tensors)),
        restore_from_saved=_restore_from_saved,
        restore_from_func_ctx=lambda ctx, return_saved_tensors=False: _restore_from_saved(
            ctx.tensor_objects, ctx.saved_tensors, return_saved_tensors
        ),
        functools=__import__("functools"),
        is_graph_capturing=lambda: False,
        _dpa_fp8_cs_o_in_f16=True,  # FP8 only; TE's default (NVTE_DPA_FP8CS_O_in_F16=1)
        combine_tensors=_combined(counter),
        get_device_compute_capability=lambda: (9, 0),  # H100
        get_cudnn_version=lambda: (9, 10, 0),  # only the thd layout's logsumexp asks
        nvtx_range_push=lambda *args: None,
        nvtx_range_pop=lambda *args: None,
    )
    attn = loader(source, names, comm)
    # from TE v1.13 the forward takes the whole sequence's lengths and divides them by cp
    whole = cp if "max_seqlen_q // cp_size" in source else 1
    padded = torch.tensor([0, s * whole], dtype=torch.int32) if whole > 1 else None
    values = {
        "is_training": True,
        "cu_seqlens_q": torch.tensor([0, s * whole], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, s * whole], dtype=torch.int32),
        "cu_seqlens_kv": torch.tensor([0, s * whole], dtype=torch.int32),
        "max_seqlen_q": s * whole,
        "max_seqlen_k": s * whole,
        "max_seqlen_kv": s * whole,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        "dropout_p": 0.0,
        "cp_group": ["a2a", "p2p"] if hierarchical else None,
        "cp_global_ranks": list(range(cp)),
        "cp_stream": _NoStream(),
        "softmax_scale": None,
        "qkv_format": "sbhd",
        "attn_mask_type": "causal",
        "attn_bias_type": "no_bias",
        "attn_bias": None,
        "deterministic": False,
        "use_fused_attention": True,
        "fp8": False,
        "fp8_meta": None,
        "quantizers": None,
        "return_max_logit": False,
        "pad_between_seqs": False,
        "use_flash_attn_3": False,
        "fp8_output": False,
        "layer_number": 1,
        "window_size": (-1, 0),
        "softmax_type": "vanilla",
        "softmax_offset": None,
    }

    def sbhd(heads, size=d):
        return torch.randn(s, b, heads, size, dtype=torch.bfloat16)

    # V and the output at their own head size under MLA
    dv = shape.get("dv", d)
    q, k, v, grad_out = sbhd(a), sbhd(kv_heads), sbhd(kv_heads, dv), sbhd(a, dv)
    values.update(q=q, k=k, v=v)
    params = list(inspect.signature(attn.forward).parameters)[1:]
    unknown = [p for p in params if p not in values]
    if unknown:
        raise SystemExit(f"TE's forward takes arguments this script does not set: {unknown}")
    ctx = types.SimpleNamespace()

    def save_for_backward(*tensors):
        ctx.saved_tensors = tensors

    ctx.save_for_backward = save_for_backward
    moved = []
    with _cpu_cuda(), _patched(torch.distributed, all_to_all_single=all_to_all_single):
        counter.bytes = 0
        with Moved():
            out = attn.forward(ctx, *(values[p] for p in params))
        moved.append(counter.bytes)
        counter.bytes = 0
        with Moved():
            attn.backward(ctx, grad_out.view(out.shape))
        moved.append(counter.bytes)
    return tuple(moved)


def _a2a_tensors(shape: dict[str, int], kv_heads: int) -> tuple[int, int, int, int]:
    """The rank's bf16 Q, K, V and output bytes of `shape` at `kv_heads` K/V heads (V and
    the output at `dv` under MLA)."""
    b, a, s, d = (shape[k] for k in "basd")
    dv = shape.get("dv", d)
    return (
        2 * b * s * a * d,
        2 * b * s * kv_heads * d,
        2 * b * s * kv_heads * dv,
        2 * b * s * a * dv,
    )


def _sibling(name: str):
    """Another script of this folder, as a module (however this one was loaded)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def backward_live(
    source: str, cp: int, shape: dict[str, int], kv_heads: int, comm: str = "a2a", rank: int = 0
) -> int:
    """(The most bytes TE's context-parallel attention backward (`comm`) holds at once on rank
    `rank` of `cp`, the most when a kernel is called) beyond what autograd hands it (dO) and
    what the forward saved: the storages its ops and the stand-in kernel allocate, alive while
    any tensor on them is (validation/torch_cp_ring_memory.py's tracker), each compiled
    function one kernel (its output alone)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    live_bytes = _sibling("torch_cp_ring_memory")._live_tracker()
    seen = {}

    def load_tracked(text, names, comm="p2p"):
        fused = names["jit_fuser"]

        def one_kernel(function):
            run = fused(function)

            def tracked(*args, **kwargs):
                tracker = seen.get("tracker")
                if tracker is None:
                    return run(*args, **kwargs)
                with _disable_current_modes():
                    out = run(*args, **kwargs)
                tracker.track(out)
                tracker.peak = max(tracker.peak, tracker.live)
                return out

            return tracked

        names["jit_fuser"] = one_kernel
        kernel = names["fused_attn_bwd"]

        def kernel_seen(*args, **kwargs):
            tracker = seen.get("tracker")
            if tracker is not None:
                seen["at_kernel"] = max(seen.get("at_kernel", 0), tracker.live)
            return kernel(*args, **kwargs)

        names["fused_attn_bwd"] = kernel_seen
        attn = load(text, names, comm)
        backward = attn.backward

        def tracked_backward(ctx, dout, *rest):
            given = [t for t in (*ctx.saved_tensors, dout) if isinstance(t, torch.Tensor)]
            tracker = live_bytes({t.untyped_storage().data_ptr() for t in given})
            seen["tracker"] = tracker
            with tracker:
                grads = backward(ctx, dout, *rest)
            seen["peak"] = tracker.peak
            return grads

        attn.backward = staticmethod(tracked_backward)
        return attn

    measure(source, cp, rank, shape, kv_heads, comm, load_tracked)
    return seen["peak"], seen["at_kernel"]


def main(
    path: str, release: str, check: bool, comm: str = "p2p", memory: bool = False, mla=False
) -> int:
    from ckplan.model import context_parallel as ours_module

    if mla and (
        comm not in ("p2p", "a2a+p2p")
        or not ours_module._release_at_least(release, ours_module.TE_MLA_CP_FIRST_RELEASE)
    ):
        raise SystemExit("--mla: the ring or a2a+p2p, Transformer Engine v2.5 on")
    if path.endswith(".whl"):
        source = source_from_wheel(path)
    else:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
    failures = 0
    for shape in MLA_SHAPES if mla else SHAPES:
        a = shape["a"]
        for kv_heads in (a,) if mla else (a, a // 2):
            for cp in CPS:
                if comm == "a2a" and (a % cp or kv_heads % cp):
                    continue  # the all-to-alls split the heads over cp
                if comm == "a2a+p2p" and (cp % A2A_SIZE or cp == A2A_SIZE):
                    continue  # a ring of two or more behind all-to-alls over A2A_SIZE
                tensors = _a2a_tensors(shape, kv_heads)
                if memory:
                    failures += _check_memory(source, release, comm, cp, shape, kv_heads)
                    continue
                ring = cp // A2A_SIZE if comm == "a2a+p2p" else cp
                seen = [measure(source, cp, rank, shape, kv_heads, comm) for rank in range(ring)]
                forward = sum(f for f, _ in seen) / ring
                backward = sum(g for _, g in seen) / ring
                if comm == "a2a":
                    ours = ours_module.te_a2a_moved_bytes(release, *tensors)
                elif comm == "allgather":
                    ours = ours_module.te_allgather_moved_bytes(release, cp, *tensors[:2])
                else:
                    ours = _ring_moved(release, ring, shape, kv_heads)
                    if comm == "a2a+p2p":
                        a2a_part = ours_module.te_hierarchical_a2a_moved_bytes(release, *tensors)
                        ours = tuple(x + y for x, y in zip(ours, a2a_part, strict=True))
                print(
                    f"{_where(shape, kv_heads, cp)}: forward {forward:,.2f} B "
                    f"(ckplan {ours[0]:,}), backward {backward:,.2f} B (ckplan {ours[1]:,})"
                )
                failures += abs(forward - ours[0]) >= 1 or abs(backward - ours[1]) >= 1
    return 1 if check and failures else 0


def _where(shape: dict, kv_heads: int, cp: int) -> str:
    """A printed line's shape: head size (Q/K and V under MLA), K/V heads, cp."""
    sizes = f"d {shape['d']}" + (f"/{shape['dv']}" if "dv" in shape else "")
    return f"{sizes}, K/V heads {kv_heads}/{shape['a']}, cp {cp}"


def _ring_moved(release: str, ring: int, shape: dict, kv_heads: int) -> tuple:
    """ckplan's bytes for the ring's loops at `ring` ranks: `te_p2p_moved_bytes`, or
    `te_p2p_mla_moved_bytes` where V's head size differs (MLA)."""
    from ckplan.model import context_parallel as ours_module

    b, a, s, d = (shape[k] for k in "basd")
    tokens = b * s
    if "dv" in shape:
        return ours_module.te_p2p_mla_moved_bytes(
            ring, tokens * a * d, tokens * a * shape["dv"], tokens * a
        )
    return ours_module.te_p2p_moved_bytes(
        release, ring, tokens * a * d, tokens * kv_heads * d, tokens * a
    )


def _ring_live(release: str, ring: int, shape: dict, kv_heads: int) -> tuple[int, int]:
    """ckplan's (at a kernel call, after the loops) live bytes of the ring's backward at
    `ring` ranks: `te_p2p_backward_live_bytes`, or `te_p2p_mla_backward_live_bytes` where V's
    head size differs (MLA)."""
    from ckplan.model import context_parallel as ours_module

    q, k, v, _ = _a2a_tensors(shape, kv_heads)
    if "dv" in shape:
        return (ours_module.te_p2p_mla_backward_live_bytes(q, k, v),) * 2
    return ours_module.te_p2p_backward_live_bytes(release, ring, q, k)


def _check_memory(source: str, release: str, comm: str, cp: int, shape: dict, kv_heads: int):
    """One --memory line: the backward's live bytes beside ckplan's; whether they differ by
    more than the reorders' int32 chunk ids (2·cp each, before and after the kernels)."""
    from ckplan.model import context_parallel as ours_module

    tensors = _a2a_tensors(shape, kv_heads)
    where = _where(shape, kv_heads, cp)
    slack = 2 * 4 * 2 * cp
    if comm == "a2a":
        peak, _ = backward_live(source, cp, shape, kv_heads)
        # the stand-in kernel's dQ, dK, dV are the op's gradients, not its transient
        ours = ours_module.te_a2a_backward_workspace_bytes(release, *tensors, 0) + sum(tensors[:3])
        print(f"{where}: backward peak {peak:,} B (ckplan {ours:,})")
        return not 0 <= peak - ours <= slack
    if comm == "a2a+p2p":
        return _check_hierarchical_memory(source, release, cp, shape, kv_heads)
    if comm == "p2p":
        return _check_p2p_memory(source, release, cp, shape, kv_heads)
    seen = [backward_live(source, cp, shape, kv_heads, comm, rank) for rank in range(cp)]
    peak, at_call = max(p for p, _ in seen), max(c for _, c in seen)
    ours = ours_module.te_allgather_backward_live_bytes(release, cp, *tensors[:2])
    print(
        f"{where}: backward peak {peak:,} B (ckplan {ours[1]:,}), at a kernel call {at_call:,} B "
        f"(ckplan {ours[0]:,})"
    )
    return not (0 <= peak - ours[1] <= slack and 0 <= at_call - ours[0] <= slack)


def _check_hierarchical_memory(source: str, release: str, cp: int, shape: dict, kv_heads: int):
    """One --memory line of a2a+p2p: its backward's peak and its peak at a kernel call on the
    busiest of the ring's ranks beside ckplan's: the kernels' dQ, dK, dV and
    `te_hierarchical_backward_workspace_bytes` around the ring's own live bytes at its size
    (`te_p2p_backward_live_bytes`), what the all-to-alls keep (dO, and O up to v2.14) at the
    calls, that and the three gradients' sends after the loops; whether they differ by more
    than the int32 chunk ids and sequence lengths. Up to v2.7 the ring's own peak comes before
    its end, so ckplan's sum is an upper bound there (by at most 2 Q-sized tensors on these
    shapes); the check then asks only that."""
    from ckplan.model import context_parallel as ours_module

    ring = cp // A2A_SIZE
    q, k, v, out = _a2a_tensors(shape, kv_heads)
    seen = [backward_live(source, cp, shape, kv_heads, "a2a+p2p", r) for r in range(ring)]
    peak, at_call = max(p for p, _ in seen), max(c for _, c in seen)
    ring_at_call, ring_at_end = _ring_live(release, ring, shape, kv_heads)
    ours = ours_module.te_hierarchical_backward_workspace_bytes(
        release, q, k, v, out, ring_at_call, ring_at_end
    )
    kept = ours_module.te_hierarchical_backward_workspace_bytes(release, q, k, v, out, 0, 0)
    kept -= ours_module._a2a_gradients_sent(q, k, v)
    where = f"{_where(shape, kv_heads, cp)} ({A2A_SIZE} x {ring})"
    print(
        f"{where}: backward peak {peak:,} B (ckplan {ours + q + k + v:,}), at a kernel call "
        f"{at_call:,} B (ckplan {ring_at_call + kept:,})"
    )
    slack = INTEGER_SLACK
    low = 0 if ours_module._release_at_least(release, "te2.8") else -math.inf
    return not (
        low <= peak - (ours + q + k + v) <= slack and 0 <= at_call - (ring_at_call + kept) <= slack
    )


def _check_p2p_memory(source: str, release: str, cp: int, shape: dict, kv_heads: int):
    """One --memory line of the point-to-point class: its backward's peak and its peak at a
    kernel call on its busiest rank, beside ckplan's `te_p2p_backward_live_bytes` (the peak
    with the dQ, dK, dV it returns); whether they differ by more than the int32 sequence
    lengths and chunk ids."""
    q, k, v, _ = _a2a_tensors(shape, kv_heads)
    seen = [backward_live(source, cp, shape, kv_heads, "p2p", r) for r in range(cp)]
    peak, at_call = max(p for p, _ in seen), max(c for _, c in seen)
    ours_at_call, ours_at_end = _ring_live(release, cp, shape, kv_heads)
    ours_peak = ours_at_end + q + k + v
    where = _where(shape, kv_heads, cp)
    print(
        f"{where}: backward peak {peak:,} B (ckplan {ours_peak:,}), at a kernel call "
        f"{at_call:,} B (ckplan {ours_at_call:,})"
    )
    return not (
        0 <= peak - ours_peak <= INTEGER_SLACK and 0 <= at_call - ours_at_call <= INTEGER_SLACK
    )


# the int32 and int64 tensors beside the counted ones: the cumulative sequence lengths, the
# random-number states, the reorders' chunk ids (bytes, an upper bound on these shapes)
INTEGER_SLACK = 512


COMMS = {"--comm=a2a": "a2a", "--comm=allgather": "allgather", "--comm=a2a+p2p": "a2a+p2p"}

if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(arguments) != 2 or not set(flags) <= {"--check", "--memory", "--mla", *COMMS}:
        sys.exit(__doc__)
    comm = next((COMMS[f] for f in flags if f in COMMS), "p2p")
    sys.exit(main(*arguments, "--check" in flags, comm, "--memory" in flags, "--mla" in flags))
