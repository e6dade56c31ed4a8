"""Stand-in of Megatron-Core's LanguageModule, written for cegen's tests.

It mirrors the contract of ``megatron/core/models/common/language_module/
language_module.py`` that cegen.megatron patches: the constructor's signature and the
attributes it sets (config, pg_collection, tp_group, cp_group, pp_group, embd_group,
vp_stage, vp_size), ``_scale_logits`` and ``shared_embedding_or_output_weight`` (what
GPTModel._postprocess calls), and ``compute_language_model_loss(self, labels, logits)``: labels
[b, s] are transposed to [s, b], the loss comes from the fused (``native`` / ``te``) or
the unfused vocab-parallel cross entropy depending on ``config.cross_entropy_loss_fusion``
and ``config.cross_entropy_fusion_impl``, and is returned as [b, s] float32. ``te`` calls
the Transformer Engine stand-in (``megatron_standin/transformer_engine``) through
``megatron.core.extensions.transformer_engine``, as Megatron-Core does.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

try:  # as in Megatron-Core: None where Transformer Engine is missing (tests may set it)
    from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy
except ImportError:
    te_parallel_cross_entropy = None

CALLS = {"compute_language_model_loss": 0}


class MegatronModule(torch.nn.Module):
    """Base module holding the config, as Megatron-Core's MegatronModule does."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config


class LanguageModule(MegatronModule):
    """Base language module (stand-in)."""

    def __init__(self, config: TransformerConfig,
                 pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = pg_collection
        self.cp_group = pg_collection.cp
        self.tp_group = pg_collection.tp
        self.pp_group = pg_collection.pp
        self.embd_group = pg_collection.embd
        self.vp_stage = None
        self.vp_size = self.config.virtual_pipeline_model_parallel_size

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """Cross entropy over the vocabulary: labels [b, s], logits [s, b, v] -> loss [b, s]."""
        CALLS["compute_language_model_loss"] += 1
        labels = labels.transpose(0, 1).contiguous()  # [b s] => [s b]
        if self.config.cross_entropy_loss_fusion:
            if self.config.cross_entropy_fusion_impl == "te":
                if te_parallel_cross_entropy is not None:
                    loss = te_parallel_cross_entropy(logits, labels, self.pg_collection.tp)
                else:
                    raise RuntimeError("Trying to use a TE block when it's not present.")
            elif self.config.cross_entropy_fusion_impl == "native":
                loss = fused_vocab_parallel_cross_entropy(logits, labels, self.pg_collection.tp)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group)
        loss = loss.transpose(0, 1).contiguous()  # [s b] => [b s]
        return loss

    def _scale_logits(self, logits: Tensor) -> Tensor:
        """MuP output scaling (``use_mup``, ``mup_output_mult``), as Megatron-Core's."""
        if not self.config.use_mup:
            return logits
        if self.config.mup_output_mult != 1.0:
            return logits * self.config.mup_output_mult
        return logits

    def shared_embedding_or_output_weight(self) -> Tensor:
        """The embedding's weight on a stage with the embedding, else the output layer's."""
        if getattr(self, "pre_process", False):
            return self.embedding.word_embeddings.weight
        if getattr(self, "post_process", False):
            return self.output_layer.weight
        return None
