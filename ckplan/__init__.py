"""ckplan: plan activation checkpointing and recomputation for large-model training."""

__version__ = "0.1.0"
