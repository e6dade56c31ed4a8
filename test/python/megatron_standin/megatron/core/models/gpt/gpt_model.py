"""A tiny GPT-like model over the LanguageModule stand-in, for cegen's tests.

Its ``_postprocess`` has the shape of Megatron-Core's GPTModel._postprocess where the
loss is computed: it takes ``loss_mask`` (as Megatron's, which passes it on to multi-token
prediction), the output layer makes [s, b, v] logits held in a local variable, which is
handed to ``self.compute_language_model_loss(labels, logits)`` and never read again.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig


class TinyGPTModel(LanguageModule):
    """hidden [s, b, h] -> logits [s, b, v] (v: this rank's vocabulary slice under tensor
    parallelism) -> per-token loss [b, s]."""

    def __init__(self, config: TransformerConfig, hidden_size: int, vocab_size: int,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 dtype: torch.dtype = torch.float32,
                 output_weight: Optional[Tensor] = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if output_weight is None:
            output_weight = torch.randn(vocab_size, hidden_size, dtype=dtype) / hidden_size ** 0.5
        # Under tensor parallelism the output layer (a ColumnParallelLinear in Megatron) holds
        # this rank's rows of the [vocab, hidden] weight, so the logits are the rank's slice.
        self.output_weight = torch.nn.Parameter(output_weight)

    def forward(self, hidden_states: Tensor, labels: Optional[Tensor] = None, *,
                loss_mask: Optional[Tensor] = None) -> Tensor:
        return self._postprocess(hidden_states, labels, loss_mask=loss_mask)

    def _postprocess(self, hidden_states: Tensor, labels: Optional[Tensor],
                     loss_mask: Optional[Tensor] = None) -> Tensor:
        logits = torch.matmul(hidden_states, self.output_weight.t())
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s b h] => [b s h]
        loss = self.compute_language_model_loss(labels, logits)
        return loss
