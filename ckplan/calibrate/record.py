"""Recording what autograd saves in one forward, storage by storage (torch needed).

`saved_tensors_hooks` sees every tensor autograd saves; each is reduced to its storage
(`untyped_storage().data_ptr()`) and each storage is counted once, with its full `nbytes()`.
Storages of parameters, buffers and the layer's non-activation inputs are excluded. A storage is
attributed to an op either by an explicit tag (`rec.op(name)` around the lines that run it, as
validation/torch_saved_bytes.py's layers do) or by ckplan.calibrate.attribute's rule over the
torch calls and modules seen while it was saved (`Call`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ckplan.calibrate.attribute import Call


@dataclass
class SavedStorage:
    op: str
    dtype: str
    shape: list[int]  # shape of the first saved tensor that referenced this storage
    tensor_bytes: int  # numel * itemsize of that tensor
    storage_bytes: int  # what the storage holds (counted)
    saves: int = 1  # how many saved-tensor references point at this storage
    ops: list[str] = field(default_factory=list)  # every op that saved it (first one counts)


class SavedTensorRecorder:
    """Counts autograd-saved storages, deduplicated, attributed to the current op tag."""

    def __init__(self, exclude_ptrs: set[int]):
        self.exclude = exclude_ptrs
        self.current = "untagged"
        self.storages: dict[int, SavedStorage] = {}
        self.excluded_refs = 0
        self._keep: list[torch.Tensor] = []  # keeps storages alive so pointers are not reused

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude:
            self.excluded_refs += 1
        elif ptr in self.storages:
            st = self.storages[ptr]
            st.saves += 1
            if self.current not in st.ops:
                st.ops.append(self.current)
        else:
            self.storages[ptr] = SavedStorage(
                op=self.current,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=list(t.shape),
                tensor_bytes=t.numel() * t.element_size(),
                storage_bytes=storage.nbytes(),
                ops=[self.current],
            )
            self._keep.append(t)
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.storages.values():
            out[s.op] = out.get(s.op, 0) + s.storage_bytes
        return out


_NULL = contextlib.nullcontext


def tag_tensor(rec: SavedTensorRecorder | None, name: str):
    return rec.op(name) if rec is not None else _NULL()


# ---- the calls and modules each save happened in (ckplan calibrate) ------------------------


@dataclass
class StorageSaves:
    """One saved storage, counted once: its size and every save of it, in order."""

    dtype: torch.dtype
    nbytes: int
    shape: list[int]  # of the first saved tensor that referenced it
    calls: list[int] = field(default_factory=list)  # the call each save happened in
    tags: list[str] = field(default_factory=list)  # the explicit tag at each save

    @property
    def elements(self) -> int:
        return self.nbytes // self.dtype.itemsize


class CallRecorder(TorchFunctionMode):
    """Records one layer forward: every top-level torch call (`attribute.Call`: its name and the
    innermost norm and projection modules it ran in) and every storage autograd saves, with the
    calls that saved it. Excluded like SavedTensorRecorder: parameters, buffers and `exclude`
    (the layer's non-activation inputs, e.g. an attention mask or RoPE's cos and sin, shared by
    every layer); also 0-dim scalars (a 1/√d tensor, RNG seeds). With `native_dropout`, F.dropout
    on a CPU tensor runs torch.native_dropout, the kernel it dispatches to on CUDA (a 1-byte mask
    instead of the CPU composite's B-byte one, docs/validation.md §2)."""

    def __init__(self, root: nn.Module, exclude: set[int], native_dropout: bool = True):
        super().__init__()
        self.root = root
        self.exclude = exclude | {p.untyped_storage().data_ptr() for p in root.parameters()}
        self.exclude |= {b.untyped_storage().data_ptr() for b in root.buffers()}
        self.native_dropout = native_dropout
        self.calls: list[Call] = []
        self.storages: dict[int, StorageSaves] = {}
        self.tag = "untagged"
        self._stack: list[tuple[str, str]] = []  # (qualified name, "norm" | "proj" | "")
        self._keep: list[torch.Tensor] = []

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:  # explicit tags, as SavedTensorRecorder.op
        previous, self.tag = self.tag, name
        try:
            yield
        finally:
            self.tag = previous

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        norm = next((q for q, kind in reversed(self._stack) if kind == "norm"), None)
        proj = next((q for q, kind in reversed(self._stack) if kind == "proj"), None)
        self.calls.append(Call(name, norm, proj))
        if self.native_dropout and func is torch.nn.functional.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(input, p=0.5, training=True, inplace=False):
        if training and p > 0 and input.device.type == "cpu":
            return torch.native_dropout(input, p, True)[0]
        return torch.nn.functional.dropout(input, p, training, inplace)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or t.dim() == 0:
            return t
        saves = self.storages.get(ptr)
        if saves is None:
            saves = self.storages[ptr] = StorageSaves(t.dtype, storage.nbytes(), list(t.shape))
            self._keep.append(t)
        saves.calls.append(len(self.calls) - 1)
        saves.tags.append(self.tag)
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        handles = []
        modules = dict(self.root.named_modules())
        wrappers = [q for q, module in modules.items() if is_adapter_wrapper(module)]
        for qualified, module in modules.items():
            if module is self.root:
                continue
            inside = any(qualified.startswith(f"{w}.") for w in wrappers)
            kind = "" if inside else module_kind(module)
            handles.append(module.register_forward_pre_hook(self._enter(qualified, kind)))
            handles.append(module.register_forward_hook(self._leave))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), self:
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, qualified: str, kind: str):
        def hook(module, args):
            self._stack.append((qualified, kind))

        return hook

    def _leave(self, module, args, output):
        self._stack.pop()


def is_adapter_wrapper(module: nn.Module) -> bool:
    """A PEFT LoRA layer: the frozen `base_layer` with its `lora_A` and `lora_B` beside it (peft
    v0.21.2, src/peft/tuners/lora/layer.py `LoraLayer`). It is one projection to the rule
    (ckplan.calibrate.attribute): the base linear, the adapters' dropout, A and B and the scaled
    add run in it, and the modules inside it are not projections of their own, so that
    `q_proj`'s adapter is qkv_proj's and `o_proj`'s out_proj's, as ckplan's sites
    (ckplan.model.finetune.SITE_OF) have them."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def module_kind(module: nn.Module) -> str:
    """ "norm" for a norm module (class name with "norm"), "proj" for a module holding a 2-D
    weight (nn.Linear, Hugging Face's Conv1D; not an embedding) or a PEFT LoRA layer
    (`is_adapter_wrapper`), "" otherwise."""
    if is_adapter_wrapper(module):
        return "proj"
    if "norm" in type(module).__name__.lower():
        return "norm"
    weight = module._parameters.get("weight")
    if weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding):
        return "proj"
    return ""
