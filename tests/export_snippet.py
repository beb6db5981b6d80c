"""The torch export of a plan, run as a user would run it, with the selective-checkpoint
contexts it creates recorded (what each checkpoint caches is read from them)."""

from __future__ import annotations


def recording_snippet(plan) -> tuple[dict, list]:
    """The namespace of `export --to torch`'s snippet for `plan`, whose
    `create_selective_checkpoint_contexts` records each forward context into the returned list."""
    import torch.utils.checkpoint as checkpoint_module

    from ckplan import exports

    namespace: dict = {}
    exec(compile(exports.export(plan, "torch").text, "snippet", "exec"), namespace)
    modes: list = []

    def recording(policy_fn):
        pair = checkpoint_module.create_selective_checkpoint_contexts(policy_fn)
        modes.append(pair[0])
        return pair

    namespace["create_selective_checkpoint_contexts"] = recording
    return namespace, modes


def cached_storages(torch, modes) -> dict[int, int]:
    """The distinct storages the selective checkpoints' caches of `modes` hold: data pointer to
    bytes (a tensor kept twice, or two views of one storage, count once)."""
    storages: dict[int, int] = {}
    for mode in modes:
        for entries in mode.storage.values():
            for wrapped in entries.values():
                for value in wrapped if isinstance(wrapped, tuple) else (wrapped,):
                    tensor = getattr(value, "val", None)
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
    return storages
