"""Two GPT-like models over the LanguageModule stand-in, for cegen's tests.

* :class:`TinyGPTModel`: its ``_postprocess`` has the shape of Megatron-Core's
  GPTModel._postprocess where the loss is computed: it takes ``loss_mask`` (as Megatron's,
  which passes it on to multi-token prediction), the output layer makes [s, b, v] logits
  held in a local variable, which is handed to ``self.compute_language_model_loss(labels,
  logits)`` and never read again.
* :class:`GPTModel`: Megatron-Core's post-processing interface (read at d98e8a64):
  ``forward`` calls ``_postprocess`` with Megatron's keyword arguments, and
  ``_postprocess`` runs the MTP block and loss where configured, an ``output_processor``,
  the output layer (a ColumnParallelLinear stand-in, with the tied embedding's weight
  passed as ``weight=``) with ``runtime_gather_output``, MuP's logit scaling, returns the
  logits ``[b, s, v]`` without labels, else ``compute_language_model_loss``. Its forward
  takes the decoder's output (no embedding or decoder here).
"""

from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor

from megatron.core.inference.utils import InferenceMode
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

CALLS = {"output_layer": 0, "mtp": 0, "process_mtp_loss": 0}


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


class _WordEmbeddings(torch.nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


class _Embedding(torch.nn.Module):
    """``embedding.word_embeddings.weight``: this rank's vocabulary rows, as
    VocabParallelEmbedding's."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.word_embeddings = _WordEmbeddings(weight)


class GPTModel(LanguageModule):
    """GPTModel's post-processing: the decoder's output ``[s, b, h]`` (``[s / tp, b, h]``
    under sequence parallelism) -> the output layer -> the loss ``[b, s]`` or the logits.

    ``output_weight``: this rank's rows of the ``[vocab, hidden]`` weight (the embedding's
    with ``share_embeddings_and_output_weights``, as on a stage that holds both).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, vocab_size: int,
                 pg_collection: Optional[ProcessGroupCollection] = None, *,
                 share_embeddings_and_output_weights: bool = False,
                 parallel_output: bool = True, post_process: bool = True,
                 mtp_process: bool = False, bias: bool = False,
                 dtype: torch.dtype = torch.float32,
                 output_weight: Optional[Tensor] = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.vocab_size = vocab_size
        self.pre_process = share_embeddings_and_output_weights  # the stage with both
        self.post_process = post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.mtp_process = mtp_process
        if share_embeddings_and_output_weights:
            if output_weight is None:
                rows = vocab_size // (self.tp_group.size() if self.tp_group is not None else 1)
                output_weight = torch.randn(rows, hidden_size, dtype=dtype) / hidden_size ** 0.5
            self.embedding = _Embedding(output_weight)
        self.output_layer = ColumnParallelLinear(
            hidden_size, vocab_size, config=config, bias=bias, skip_bias_add=False,
            gather_output=not parallel_output,
            skip_weight_param_allocation=share_embeddings_and_output_weights,
            tp_group=self.pg_collection.tp, weight=output_weight, dtype=dtype)

    def mtp(self, hidden_states: Tensor, **kwargs: Any) -> Tensor:
        """The MTP block (stand-in: counts the call, returns the hidden states)."""
        CALLS["mtp"] += 1
        return hidden_states

    def forward(self, hidden_states: Tensor, labels: Optional[Tensor] = None, *,
                loss_mask: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None,
                inference_context: Any = None,
                output_processor: Optional[Callable[..., Any]] = None) -> Tensor:
        return self._postprocess(
            hidden_states=hidden_states, input_ids=None, position_ids=None, labels=labels,
            rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
            mtp_in_postprocess=self.mtp_process, loss_mask=loss_mask, decoder_input=None,
            attention_mask=None, padding_mask=None, inference_params=None,
            packed_seq_params=None, sequence_len_offset=None,
            runtime_gather_output=runtime_gather_output, extra_block_kwargs=None,
            inference_context=inference_context, output_processor=output_processor,
            output_processor_context=None)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None,
                     decoder_input=None, attention_mask=None, padding_mask=None,
                     inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None,
                     inference_context=None, output_processor=None,
                     output_processor_context=None):
        in_inference_mode = InferenceMode.is_active()
        if in_inference_mode:
            assert runtime_gather_output, "Inference must always gather TP logits"
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        if mtp_in_postprocess and not in_inference_mode:
            hidden_states = self.mtp(hidden_states=hidden_states)
        if not self.post_process:
            return hidden_states
        if self.config.mtp_num_layers and not in_inference_mode:
            # Megatron's process_mtp_loss: the MTP losses from the output layer's logits of
            # the MTP hidden states, attached to the main hidden states (not modelled).
            CALLS["process_mtp_loss"] += 1
        if output_processor is not None:
            return output_processor(hidden_states=hidden_states, output_layer=self.output_layer,
                                    output_weight=output_weight, labels=labels,
                                    loss_mask=loss_mask)
        CALLS["output_layer"] += 1
        logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                      runtime_gather_output=runtime_gather_output)
        logits = self._scale_logits(logits)
        if self.config.config_logger_dir:
            self.logged_logits = logits  # Megatron writes them to disk
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s b h] => [b s h]
        loss = self.compute_language_model_loss(labels, logits)
        return loss
