"""Stand-in of torchtitan.train's Trainer (v0.2.2): how it builds and calls its loss.

Written for cegen's tests. As TorchTitan's: the trainer imports ``custom_import``, takes
the TrainSpec named by ``model.name``, builds the loss with
``train_spec.build_loss_fn(job_config, parallel_dims=...)``, and
``forward_backward_step`` (the non-pipeline path) runs ``pred = model(inputs)``,
``loss_sum = self.loss_fn(pred, labels)``, ``loss = loss_sum / global_valid_tokens``,
``del pred``, ``loss.backward()``; ``train_step`` counts the valid tokens
(``labels != IGNORE_INDEX``) of its microbatches, runs them and steps the optimizer
(plain SGD here).
"""

import importlib
from typing import Iterable, List, Tuple

import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.protocols import train_spec as train_spec_module


class Trainer:
    def __init__(self, job_config: JobConfig, lr: float = 0.1) -> None:
        self.job_config = job_config
        if job_config.experimental.custom_import:
            importlib.import_module(job_config.experimental.custom_import)
        self.train_spec = train_spec_module.get_train_spec(job_config.model.name)
        model_args = self.train_spec.model_args[job_config.model.flavor]
        self.model_parts = [self.train_spec.model_cls(model_args)]
        self.loss_fn = self.train_spec.build_loss_fn(job_config, parallel_dims=None)
        self.optimizer = torch.optim.SGD(self.model_parts[0].parameters(), lr=lr)

    def forward_backward_step(self, *, input_dict, labels: torch.Tensor,
                              global_valid_tokens: torch.Tensor) -> torch.Tensor:
        inputs = input_dict["input"]
        pred = self.model_parts[0](inputs)
        loss_sum = self.loss_fn(pred, labels)
        loss = loss_sum / global_valid_tokens
        del pred
        loss.backward()
        return loss

    def train_step(self, microbatches: Iterable[Tuple[dict, torch.Tensor]]) -> float:
        self.optimizer.zero_grad()
        microbatches = list(microbatches)
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _, labels in microbatches:
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
        global_valid_tokens = local_valid_tokens.float()
        losses: List[torch.Tensor] = []
        for input_dict, labels in microbatches:
            losses.append(self.forward_backward_step(
                input_dict=input_dict, labels=labels,
                global_valid_tokens=global_valid_tokens).detach())
        self.optimizer.step()
        return float(torch.stack(losses).sum())
