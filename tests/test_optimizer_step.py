"""The optimizer step as a phase of the step's memory, and its code path (fused or foreach).

torch.optim.AdamW's foreach step copies every exp_avg_sq (`_foreach_sqrt`) before it updates
the parameters; the fused step updates in place; transformers' Adafactor holds fp32
temporaries of its largest tensor. Each is checked against the library itself (skipped
without it), the bytes, the defaults and the exports by hand (docs/memory.md, "The optimizer
step")."""

import pytest
from test_optimizers import SMALL, P

from ckplan.hardware.roofline import memory_seconds
from ckplan.hardware.step_time import optimizer_seconds, optimizer_step_bytes_per_parameter
from ckplan.inputs.gpus import load_gpu
from ckplan.model import frameworks, optimizers
from ckplan.model.memory import model_state_bytes, optimizer_workspace_bytes, parameter_count
from ckplan.model.spec import SpecError, spec_from_mapping
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import parse_strategy

OLD = {**SMALL, "framework_version": "4.44"}  # transformers v4.44's Trainer: adamw_torch


def spec(**changes):
    return spec_from_mapping({**OLD, **changes})


def plan_of(model, strategy="full"):
    return evaluate(model, parse_strategy(strategy, model))


def test_foreach_kernels_by_hand():
    # fp32 parameter, gradient and moments: weight decay 2·4, lerp 2·4 + 4, mul 2·4,
    # addcmul 2·4 + 4, sqrt/div/add 3·2·4, addcdiv 2·4 + 2·4
    assert optimizers.foreach_adamw_step_bytes_per_parameter(4, 0, 4, 8) == 80
    # a master copy stepped (p = 4) beside bf16 working weights written once (2)
    assert optimizers.foreach_adamw_step_bytes_per_parameter(4, 4, 2, 8) == 82
    # bf16 parameters and moments: 4·2 + 14·2 + 2·2
    assert optimizers.foreach_adamw_step_bytes_per_parameter(2, 0, 2, 4) == 40
    assert optimizers.foreach_adamw_workspace_bytes(1000, 8) == 4000
    assert optimizers.foreach_adamw_workspace_bytes(1000, 4) == 2000


@pytest.mark.parametrize(
    ("changes", "implementation"),
    [
        ({}, "foreach"),  # v4.44's default optim, adamw_torch
        ({"framework_version": "5.25"}, "fused"),  # adamw_torch_fused from torch 2.8
        ({"optimizer": "adamw-8bit"}, "fused"),  # bitsandbytes' own kernel
        ({"optimizer": "adamw-bf16"}, "fused"),  # the Trainer's adamw_anyprecision
        ({"framework": "torchtitan", "framework_version": None}, "fused"),  # its default
        ({"framework": "megatron", "framework_version": None}, "fused"),
        ({"framework": "deepspeed", "framework_version": None}, "fused"),  # the Trainer's, 5.25
        ({"framework": "deepspeed"}, "foreach"),  # the Trainer's adamw_torch as the client's
        ({"framework": "deepspeed", "framework_version": "0.5.4"}, "fused"),  # FusedAdam
        ({"framework_version": "5.25", "optimizer_implementation": "foreach"}, "foreach"),
        ({"optimizer_implementation": "fused"}, "fused"),
        (
            {
                "framework": "torchtitan",
                "framework_version": None,
                "optimizer_implementation": "foreach",
            },
            "foreach",
        ),
        ({"optimizer": "adamw-bf16", "optimizer_implementation": "foreach"}, "foreach"),
    ],
)
def test_the_default_follows_the_framework(changes, implementation):
    assert frameworks.optimizer_implementation(spec(**changes)) == implementation


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"optimizer_implementation": "for-loop"}, "key 'optimizer_implementation' must be one of"),
        (
            {
                "framework": "megatron",
                "framework_version": None,
                "optimizer_implementation": "fused",
            },
            "megatron steps with its own fused Adam",
        ),
        ({"optimizer": "adamw-8bit", "optimizer_implementation": "foreach"}, "not adamw-8bit"),
    ],
)
def test_refused(changes, fragment):
    with pytest.raises(SpecError, match=fragment):
        spec(**changes)


def test_one_gpu_step_holds_every_state_and_the_copy():
    """One GPU: fp32 weights (4), every gradient (4), AdamW's moments (8) and the copy of
    exp_avg_sq (4): 20 bytes a parameter, above the backward's peak of this small model."""
    model = spec()
    plan = plan_of(model)
    assert optimizer_workspace_bytes(model) == 4 * P
    assert plan.optimizer_step_bytes == 20 * P
    fused = plan_of(spec(optimizer_implementation="fused"))
    assert fused.optimizer_step_bytes == 0
    assert plan.total_bytes == max(fused.total_bytes, 20 * P)


def test_ddp_keeps_its_buckets_at_the_step():
    """DDP over two ranks (zero 0): the reducer's fp32 buckets (4 B/param) stay; the states
    are whole on each rank."""
    plan = plan_of(spec(dp=2, zero=0))
    assert plan.optimizer_step_bytes == (20 + 4) * P


def test_deepspeed_zero3_keeps_its_bucket_at_the_step():
    """The Trainer's foreach AdamW as DeepSpeed's client optimizer over its fp32 partitions
    (ZeRO-3 over two ranks): the partition's master weights, moments and gradients, the bf16
    weights' partition and the IPG bucket ZeRO-3 allocates at init (2 bytes x 5e8)."""
    model = spec(framework="deepspeed", dp=2, zero=3)
    states = model_state_bytes(model)
    workspace = optimizer_workspace_bytes(model)
    assert workspace == 4 * P // 2  # exp_avg_sq of the fp32 partition
    held = states.weights + states.gradients + states.optimizer + 2 * 500_000_000
    assert plan_of(model).optimizer_step_bytes == held + workspace


def test_fsdp_shards_the_step():
    """FSDP over two ranks (zero 3): every state and the copy are the rank's half; FSDP has
    resharded its units by the step."""
    model = spec(dp=2, zero=3)
    states = model_state_bytes(model)
    plan = plan_of(model)
    assert optimizer_workspace_bytes(model) == 4 * P // 2
    assert plan.optimizer_step_bytes == states.weights + states.gradients + states.optimizer + 2 * P
    assert plan.optimizer_step_bytes == 20 * P // 2


def test_adapters_alone_are_stepped():
    """LoRA: the copy covers the trainable adapters only (fp32 under hf)."""
    model = spec(training="lora", lora_targets="all-linear")
    trained = parameter_count(model).trained
    states = model_state_bytes(model)
    assert optimizer_workspace_bytes(model) == 4 * trained
    held = states.weights + states.gradients + states.optimizer
    assert plan_of(model).optimizer_step_bytes == held + 4 * trained


@pytest.mark.parametrize(
    "changes", [{"optimizer_offload": "cpu", "param_offload": "cpu", "dp": 2, "zero": 3},
                {"optimizer_in_backward": True}]
)  # fmt: skip
def test_no_device_workspace(changes):
    """A step on the host, or one tensor at a time in backward, copies nothing on the GPU."""
    model = spec(**changes)
    assert optimizer_workspace_bytes(model) == 0
    assert plan_of(model).optimizer_step_bytes == 0


def test_step_time_follows_the_kernels():
    gpu = load_gpu("rtx-4090")
    foreach, fused = spec(), spec(optimizer_implementation="fused")
    assert optimizer_step_bytes_per_parameter(foreach) == 80
    assert optimizer_step_bytes_per_parameter(fused) == optimizers.step_bytes_per_parameter(
        "adamw", 4, 0, 4, 8
    )
    assert optimizer_seconds(foreach, gpu) == pytest.approx(memory_seconds(gpu, 80 * P))


def test_sweep_says_the_step_sets_the_peak():
    """When the step holds the peak, no recomputation fits it: `why_not_fitting` names it."""
    from ckplan.plan.search import Candidate
    from ckplan.render.sweep import why_not_fitting

    plan = plan_of(spec())
    assert plan.step_sets_peak
    candidate = Candidate(plan=plan, budget_bytes=plan.optimizer_step_bytes - 1)
    assert why_not_fitting(candidate).startswith("the optimizer step")


def test_the_fused_step_is_offered_first():
    """Among the levers that fit on the same GPUs, the one that trains the same model the same
    way comes first: AdamW's fused step (a 1.5B model, every weight, on one GPU)."""
    from ckplan.plan.advice import advise

    model = spec(
        layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab=128256, seq=2048
    )
    usable = 27 * 2**30  # the fused plan: 26.67 GiB, in the backward; foreach: 27.91 GiB
    assert plan_of(model).budgeted_bytes > usable
    first = advise(model, usable, pcie=True)[0]
    assert first.keys == {"optimizer_implementation": "fused"} and first.fits


# ---- against PyTorch -------------------------------------------------------------------------


def _traced_peak(torch, step) -> int:
    """The bytes `step()` allocates at its peak beyond what was live, every allocation of its
    ops traced (on CPU tensors)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.storages = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {
                tensor.untyped_storage().data_ptr()
                for tensor in tree_leaves((args, kwargs))
                if isinstance(tensor, torch.Tensor)
            }
            for tensor in tree_leaves(out):
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size == 0 or key in self.storages or key in inputs:
                    continue  # an in-place op's output, or a view
                self.storages.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, size)
            return out

        def _freed(self, key, size):
            self.storages.discard(key)
            self.live -= size

    with Allocations() as traced:
        step()
    return traced.peak


def _stepped_peak(torch, implementation: str, shapes) -> tuple[int, int]:
    """(bytes the second step allocates at its peak beyond what was live, Adam's exp_avg_sq
    bytes) of torch.optim.AdamW on CPU tensors."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    optimizer = torch.optim.AdamW(parameters, **{implementation: True})
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()  # the first step makes the states
    moment = sum(optimizer.state[p]["exp_avg_sq"].nbytes for p in parameters)
    return _traced_peak(torch, optimizer.step), moment


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_against_torch(implementation):
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    shapes = [(64, 96), (96, 64), (64,), (256, 64)]
    peak, moment = _stepped_peak(torch, implementation, shapes)
    elements = sum(a * (b[0] if b else 1) for a, *b in shapes)
    model_bytes = optimizers.foreach_adamw_workspace_bytes(elements, 8)
    assert moment == model_bytes  # fp32 moments: 4 bytes each
    assert peak == (model_bytes if implementation == "foreach" else 0)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_adafactor_against_transformers(dtype_name):
    """transformers' Adafactor (the Trainer's `optim="adafactor"`: no first moment, factored
    second moments) steps tensor by tensor: its allocations peak at the largest tensor's
    temporaries, two fp32 copies of it (four with half parameters and gradients), plus its
    factored rows' and columns' statistics."""
    from needs_frameworks import framework_or_skip
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    transformers = framework_or_skip("transformers")
    dtype = getattr(torch, dtype_name)
    shapes = [(256, 64), (96, 64), (64,)]
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]
    optimizer = transformers.Adafactor(
        parameters, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False
    )
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()  # the first step makes the states
    peak = _traced_peak(torch, optimizer.step)
    half = 2 if dtype_name == "bfloat16" else 4
    rows, columns = shapes[0]
    expected = optimizers.adafactor_workspace_bytes(rows * columns, half, half)
    assert expected <= peak <= expected + 4 * 4 * (rows + columns)  # the factors' vectors


def test_adafactor_step_holds_its_largest_tensors_temporaries():
    """Adafactor (fp32 weights and gradients under hf): two fp32 temporaries of the largest
    trained tensor, the 256 x 64 output layer of this small model (untied), whatever the
    framework's AdamW implementation."""
    model = spec(optimizer="adafactor")
    assert optimizer_workspace_bytes(model) == 2 * 4 * 256 * 64
    states = model_state_bytes(model)
    held = states.weights + states.gradients + states.optimizer
    assert plan_of(model).optimizer_step_bytes == held + 2 * 4 * 256 * 64
