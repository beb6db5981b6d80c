"""The allocated peak of one FSDP2 training step of torchtitan's own Llama 3 8B, per phase and per
category, measured with PyTorch's own FSDP2 memory tracker on the CPU without real memory: the
check behind torchtitan's FSDP2 buffers in ckplan (`frameworks.fsdp2_buffer_bytes`,
docs/memory.md, docs/validation.md).

Set-up (torch/distributed/_tools/fsdp2_mem_tracker.py, PyTorch v2.13.0): a fake process group
of 8 ranks (torch.testing._internal.distributed.fake_pg.FakeStore), the model built under
FakeTensorMode (shapes only), `FSDPMemTracker(model, optimizer)` around two training steps; its
categories are the sharded and unsharded parameters, sharded and unsharded gradients, the
all-gather outputs and reduce-scatter inputs, optimizer states, activations (forward and
recomputation) and temporaries (backward). The model is torchtitan 0.3.0's Llama 3 8B
(`torchtitan.models.llama3._8b`: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab
128256, fused QKV), its attention torchtitan's `ScaledDotProductAttention` (FlexAttention has no
CPU backward), torchtitan's `FullAC` or per-op `SelectiveAC`; fully_shard with
MixedPrecisionPolicy(param bf16, reduce fp32, cast_forward_inputs off) in one of three layouts:

- `202412`: torchtitan 9dec370's apply_fsdp (the Dec 2024 benchmark): every block resharded
  after forward but the last, the root module (embedding, final norm, output) the root FSDP
  unit, which FSDP2 never reshards after forward;
- `0.3.0`: torchtitan 0.3.0's apply_fsdp_to_decoder: the embedding its own unit, resharded; the
  final norm and output one unit not resharded; every block resharded;
- `accelerate`: accelerate v1.14.0's `fsdp2_prepare_model` under the Hugging Face Trainer
  (fsdp_version 2, the default of transformers v5.25): `0.3.0`'s units, with the policy
  `set_mixed_precision("bf16")` builds, MixedPrecisionPolicy(param bf16, reduce bf16, output
  bf16), so the reduce-scatter input is bf16.

The loss is torchtitan's eager cross-entropy on fp32-upcast logits, the optimizer AdamW with
foreach off (torchtitan's default is `fused`, one kernel per parameter group that updates in
place: no temporaries; under FakeTensorMode the DTensor foreach and fused paths allocate
unsharded copies a CUDA run does not, so they are not measured here).

Phases (iteration 2, the states allocated): `forward` ends before the loss, `loss` after it,
`backward` the peak of the backward, `step` the optimizer step's.
The CPU's differences from a CUDA run: SDPA runs `_scaled_dot_product_flash_attention_for_cpu`
(it saves the output and a fp32 logsumexp, as the CUDA flash kernel does); no CUDA streams, so
a freed all-gather output is free at once (on CUDA FSDP2 holds it until the next all-gather's
copy-in waits on it, _fsdp_param_group.py `AllGatherState`).

Needs torch (2.13.0 was run) and torchtitan (0.3.0); prints JSON with --json, writes it with
--write. Results: validation/results-fsdp2-memory-torch-2.13.0.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = "validation/results-fsdp2-memory-torch-2.13.0.json"
WORLD = 8
# torchtitan 0.3.0's Llama 3 8B (torchtitan/models/llama3/__init__.py `_8b`)
SHAPE = {"dim": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "layers": 32, "vocab": 128256}
CASES = (
    {"layout": "202412", "ac": "op", "micro_batch": 2, "seq": 8192},
    {"layout": "0.3.0", "ac": "op", "micro_batch": 2, "seq": 8192},
    {"layout": "202412", "ac": "full", "micro_batch": 1, "seq": 32768},
    {"layout": "accelerate", "ac": "op", "micro_batch": 2, "seq": 8192},
)


def build_llama3(shape: dict, **layer_options):
    """torchtitan 0.3.0's Llama 3 at `shape` (`_build_llama3_layers` with `layer_options`), its
    attention torchtitan's ScaledDotProductAttention (FlexAttention has no CPU backward)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim, heads, vocab = shape["dim"], shape["heads"], shape["vocab"]
    layers = _build_llama3_layers(
        n_layers=shape["layers"],
        dim=dim,
        n_heads=heads,
        n_kv_heads=shape["kv_heads"],
        hidden_dim=shape["ffn"],
        rope=ComplexRoPE.Config(
            dim=dim // heads, max_seq_len=shape["seq"], theta=500000, scaling="none"
        ),
        attn_backend="flex",
        **layer_options,
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers,
    ).build()


def build(torch, shape, ac, layout, mesh):
    """torchtitan's Llama 3 at `shape` under FakeTensorMode (active), checkpointed and sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    model = build_llama3(shape)
    policy = {"full": FullAC, "op": SelectiveAC}[ac]
    policy(policy.Config()).apply(model)
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    if layout == "accelerate":  # accelerate/utils/dataclasses.py `set_mixed_precision`, v1.14.0
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
        )
    blocks = list(model.layers.values())
    if layout in ("0.3.0", "accelerate"):
        fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(
            [model.norm, model.lm_head], mesh=mesh, mp_policy=mp, reshard_after_forward=False
        )
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        reshard = layout in ("0.3.0", "accelerate") or not last
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _total(snapshot) -> dict[str, int]:
    (device,) = snapshot
    return {str(getattr(key, "value", key)): int(value) for key, value in snapshot[device].items()}


def _reset_peak(tracker) -> None:
    """Start a new peak at the current bytes (MemTracker.__enter__ does the same)."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}


def measure(case: dict, shape: dict = SHAPE) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    batch, seq = case["micro_batch"], case["seq"]
    with FakeTensorMode():
        model = build(torch, {**shape, "seq": seq}, case["ac"], case["layout"], mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        tokens = torch.randint(0, shape["vocab"], (batch, seq))
        labels = torch.randint(0, shape["vocab"], (batch, seq))
        positions = torch.arange(seq).repeat(batch, 1)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens, labels))
        phases: dict[str, dict[str, int]] = {}
        with tracker:
            for _iteration in range(2):  # the second with the states allocated
                _reset_peak(tracker)
                logits = model(tokens, positions=positions)
                phases["forward"] = _total(tracker.get_tracker_snapshot("peak"))
                _reset_peak(tracker)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
                del logits
                phases["loss"] = _total(tracker.get_tracker_snapshot("peak"))
                _reset_peak(tracker)
                loss.backward()
                phases["backward"] = _total(tracker.get_tracker_snapshot("peak"))
                _reset_peak(tracker)
                optimizer.step()
                phases["step"] = _total(tracker.get_tracker_snapshot("peak"))
                optimizer.zero_grad()
                tracker.reset_mod_stats()
        dist.destroy_process_group()
    peak = max(phases, key=lambda phase: phases[phase]["Total"])
    return {**case, **shape, "world": WORLD, "peak_phase": peak, "phases": phases}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args(argv)
    cases = report([measure(case) for case in CASES], RESULTS, args)
    if not args.json:
        for case in cases:
            print(case["layout"], case["ac"], case["micro_batch"], case["seq"], case["peak_phase"])
            for phase, categories in case["phases"].items():
                print(f"  {phase:9s}", {k: round(v / 2**20) for k, v in categories.items() if v})
    return 0


def report(cases: list[dict], results: str | Path, args: argparse.Namespace) -> list[dict]:
    """The measured cases with the torch and torchtitan releases: written to `results` with
    --write, printed as JSON with --json."""
    import torch
    import torchtitan

    out = {
        "torch": torch.__version__.split("+")[0],
        "torchtitan": getattr(torchtitan, "__version__", "0.3.0"),
        "cases": cases,
    }
    text = json.dumps(out, indent=1)
    if args.write:
        with open(results, "w") as handle:
            handle.write(text + "\n")
    if args.json:
        print(text)
    return cases


if __name__ == "__main__":
    sys.exit(main())
