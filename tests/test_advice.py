"""Advice when nothing fits: derived from the model's layout, never a fixed example."""

import json

from ckplan.cli import main
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.plan.advice import advise, least_bytes, over_pcie

GIB = 2**30
TP8_PP2 = {"tp": 8, "sp": True, "pp": 2, "microbatches": 8}


def test_every_advice_raises_a_lever_and_fits_when_applied():
    spec = load_spec("llama3-70b", TP8_PP2)
    usable = 38 * GIB
    found = advise(spec, usable)
    assert found and all(a.fits for a in found)
    for a in found:
        changed = spec.replace(**a.keys)
        assert least_bytes(changed) == a.total_bytes <= usable
        gpus = changed.tp * changed.pp * changed.cp * changed.dp
        assert gpus == a.gpus_factor * 128 / 8  # tp 8 x pp 2 today
        for key in ("tp", "pp", "dp", "cp", "zero"):
            if key in a.keys:
                assert a.keys[key] > getattr(spec, key)  # raised from where it stands
        assert "tp" not in a.keys  # tp 8 fills the node already


def test_no_advice_when_the_least_plan_fits():
    spec = load_spec("gpt2")
    assert least_bytes(spec) < 70 * GIB
    assert advise(spec, 70 * GIB) == []


def test_sweep_at_tp8_pp2_advises_from_its_layout(capsys):
    """Sweep on a model already at tp 8 pp 2 must not say "shard them over at least 2 GPUs";
    it names what to raise from there and the memory that results."""
    argv = ["sweep", "llama3-70b", "--budget", "40GB"]
    for key, value in TP8_PP2.items():
        argv += ["--set", f"{key}={str(value).lower()}"]
    code = main(argv)
    out, _ = capsys.readouterr()
    assert code == 1
    text = " ".join(out.split())
    assert "shard them over" not in text
    assert "From this layout: --set" in text and "per GPU with full recomputation (fits;" in text
    code = main([*argv, "--json"])
    advice = json.loads(capsys.readouterr().out)["advice"]
    assert advice and all("--set" in line for line in advice)


def test_estimate_optimal_no_fit_names_a_lever(capsys):
    code = main(["estimate", "llama3-70b", "--strategy", "optimal", "--budget", "80GB"])
    _, err = capsys.readouterr()
    assert code == 1 and len(err.splitlines()) == 1
    assert "from this layout: --set" in err


def test_check_advises_each_model_that_does_not_fit(capsys):
    code = main(["check", "gpt2", "llama3-70b", "--budget", "80GB", "--json"])
    results = json.loads(capsys.readouterr().out)["results"]
    assert code == 1
    assert results[0]["fits"] and results[0]["advice"] == []
    assert not results[1]["fits"] and results[1]["advice"][0].startswith("--set ")
    code = main(["check", "gpt2", "llama3-70b", "--budget", "80GB"])
    out = " ".join(capsys.readouterr().out.split())
    assert "llama3-70b: from its layout, --set" in out


def test_a_chunked_loss_is_a_lever_on_the_same_gpus(spec_of):
    """Llama-3-8B's 128k vocabulary: the eager loss holds fp32 logits of the whole vocabulary;
    computing the loss in chunks fits without more GPUs, and is offered first."""
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3)
    usable = least_bytes(spec) - 2 * 2**30  # two GiB short with every layer recomputed
    first = advise(spec, usable)[0]
    assert first.keys == {"loss": "chunked:4"} and first.fits and first.gpus_factor == 1
    chunked = spec.replace(loss="chunked:4")
    assert least_bytes(chunked) <= usable < least_bytes(spec)
    assert all("loss" not in a.keys for a in advise(chunked, least_bytes(chunked) - 1))


def test_one_gpu_fine_tune_names_the_fine_tuning_levers():
    """A full fine-tune of an 8B model on one 24 GB PCIe card: LoRA, QLoRA, an 8-bit
    optimizer, the step in backward, the chunked loss, each with what it gives alone; FSDP over
    more GPUs; never tensor or pipeline parallelism across PCIe cards."""
    spec = load_spec("llama3-8b", {"seq": 2048})
    usable = 22 * GIB
    assert over_pcie(load_gpu("rtx-4090")) and not over_pcie(load_gpu("h100-sxm"))
    found = advise(spec, usable, pcie=True)
    keys = [a.keys for a in found]
    # Megatron-LM (the preset's framework) has no adapters: they are offered under the Trainer,
    # whose fp32 weights leave LoRA over and QLoRA fitting
    assert keys[0] == {"training": "qlora", "framework": "hf"} and found[0].fits
    assert found[0].gpus_factor == 1 and {"training": "lora", "framework": "hf"} not in keys
    assert {"optimizer": "adamw-8bit"} in keys
    assert {"optimizer_in_backward": True} in keys
    assert any("loss" in k for k in keys)
    assert all("tp" not in k and "pp" not in k and "cp" not in k for k in keys)
    for a in found:
        assert least_bytes(spec.replace(**a.keys)) == a.total_bytes
    # Hugging Face's fp32 weights: LoRA alone is still over, QLoRA fits
    hf = load_spec("llama3-8b", {"seq": 2048, "framework": "hf"})
    first = advise(hf, usable, pcie=True)[0]
    assert first.keys == {"training": "qlora"} and first.fits
    # a LoRA run on one GPU of unknown link: the fine-tune's levers beside tp within a node;
    # an 8-bit optimizer is not offered again, nor LoRA once training is lora
    lora = load_spec("llama3-8b", {"training": "lora", "optimizer": "adamw-8bit", "seq": 2048})
    keys = [a.keys for a in advise(lora, 4 * GIB)]
    assert not any(k.get("training") == "lora" for k in keys)
    assert {"optimizer": "adamw-8bit"} not in keys
    # the LoRA run names no framework: the Trainer's (adapters' default), QLoRA offered as is
    assert lora.framework == "hf" and {"training": "qlora"} in keys
    # full training on one GPU of unknown link: the layout's levers as before
    keys = [a.keys for a in advise(spec, usable)]
    assert {"training": "lora"} not in keys and any("tp" in k for k in keys)


def test_sweep_on_a_pcie_card_advises_the_fine_tune(capsys):
    code = main(["sweep", "llama3-8b", "--gpu", "rtx-4090", "--seq", "2048", "-q", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert data["advice"][0].startswith("--set training=qlora --set framework=hf: ")
    assert not any("--set tp=" in line for line in data["advice"])


def test_model_states_on_the_host_are_a_lever_checked_against_host_memory():
    """Llama-3-8B full training with DeepSpeed on one RTX 4090: ZeRO-Offload takes the states
    off the GPU, but 8e9 parameters' fp32 states are more than a GPU's share of the preset's
    host memory; with a larger host it fits."""
    gpu = load_gpu("rtx-4090")
    spec = load_spec("llama3-8b", {"seq": 4096, "framework": "deepspeed"})
    from ckplan.hardware.host_link import host_memory_per_gpu
    from ckplan.plan.search import DEFAULT_RESERVE

    usable = gpu.memory_bytes - DEFAULT_RESERVE
    found = advise(spec, usable, 1, over_pcie(gpu), host_memory_per_gpu(gpu))
    offload = [a for a in found if a.keys.get("optimizer_offload") == "cpu"]
    assert offload and all(a.host is not None and not a.fits for a in offload)
    assert all(a.total_bytes <= usable and a.host[0] > a.host[1] for a in offload)
    roomy = advise(spec, usable, 1, over_pcie(gpu), 10**12)
    assert any(a.fits and a.keys.get("optimizer_offload") == "cpu" for a in roomy)
    # frameworks that cannot offload states get no such lever
    megatron = advise(load_spec("llama3-8b", {"seq": 4096}), usable, 1, True, 10**12)
    assert not any("optimizer_offload" in a.keys for a in megatron)


def test_a_fine_tune_over_several_gpus_moves_its_states_before_adding_gpus():
    """Llama-2-70B QLoRA over FSDP on two RTX 4090s at 2 x 2048 tokens (PEFT's documented
    FSDP-QLoRA recipe): over budget with full recomputation; FSDP's CPU offload, the frozen
    shards and the adapters' states on the host, fits on the same two GPUs and comes before
    twice the GPUs."""
    gpu = load_gpu("rtx-4090")
    spec = load_spec(
        "llama2-70b",
        {"training": "qlora", "weight_format": "nf4", "framework": "hf", "zero": 3, "dp": 2,
         "seq": 2048, "micro_batch": 2},
    )  # fmt: skip
    from ckplan.hardware.host_link import host_memory_per_gpu
    from ckplan.plan.search import DEFAULT_RESERVE

    usable = gpu.memory_bytes - DEFAULT_RESERVE
    assert least_bytes(spec) > usable
    found = advise(spec, usable, gpu.gpus_per_node, over_pcie(gpu), host_memory_per_gpu(gpu))
    assert found[0].keys == {"optimizer_offload": "cpu", "param_offload": "cpu"}  # zero 3 already
    assert found[0].fits and found[0].total_bytes <= usable
    assert any(a.keys.get("dp") == 4 for a in found[1:])
