"""Hardware: GPUs and the time model of a training step on them.

gpus             a GPU's datasheet figures and efficiencies (GPU, gpu_from_mapping)
roofline         one op's time on a GPU (OpTime)
communication    ring collectives and the collectives of a step
expert_parallel  the token dispatcher's collectives of one MoE layer
times            the time records of a chain stage and a micro-batch
step_time        one training iteration composed from the op table (StepTime, step_time)
stage_table      a long chain's stage times as NumPy arrays (bit-identical to step_time)
host_link        the GPU-to-host link and host memory (activation offloading)
cpu              the `cpu` device profile `ckplan verify` measures on the spot
device_memory    the peak as nvidia-smi shows it: reserved + CUDA context, NCCL, paged states
"""

__all__ = [
    "code_path",
    "communication",
    "cpu",
    "device_memory",
    "expert_parallel",
    "gpus",
    "host_link",
    "roofline",
    "stage_table",
    "step_time",
    "times",
]
