"""Stand-in of torchtitan.components.loss (v0.2.2), written for cegen's tests.

As TorchTitan's: ``cross_entropy_loss(pred, labels)`` flattens ``[B, S, V]`` logits and
``[B, S]`` labels, computes PyTorch's cross entropy in fp32 with ``reduction="sum"`` and
``ignore_index=IGNORE_INDEX`` (-100); ``build_cross_entropy_loss(job_config, **kwargs)``
returns it, compiled when ``job_config.compile`` asks for the loss to be compiled.
``CALLS`` counts the calls (the tests' way to see a fallback).
"""

from typing import Callable, TypeAlias

import torch

from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

IGNORE_INDEX = -100

LossFunction: TypeAlias = Callable[..., torch.Tensor]

CALLS = {"cross_entropy_loss": 0}


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy loss with sum reduction for token-based normalization."""
    CALLS["cross_entropy_loss"] += 1
    return torch.nn.functional.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
        ignore_index=IGNORE_INDEX)


def build_cross_entropy_loss(job_config: JobConfig, **kwargs):
    del kwargs
    loss_fn = cross_entropy_loss
    if job_config.compile.enable and "loss" in job_config.compile.components:
        logger.info("Compiling the loss function with torch.compile")
        loss_fn = torch.compile(loss_fn, backend=job_config.compile.backend)
    return loss_fn
