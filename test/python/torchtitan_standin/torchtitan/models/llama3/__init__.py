"""A tiny stand-in of TorchTitan's llama3 model package, for cegen's tests.

``Transformer`` maps tokens ``[B, S]`` to logits ``[B, S, V]`` (an embedding, one tanh
layer and an output projection, in the model's dtype), as TorchTitan's decoder's output
layer does; ``get_train_spec()`` names TorchTitan's cross entropy as its loss.
"""

from dataclasses import dataclass

import torch

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.protocols.train_spec import TrainSpec


@dataclass
class TransformerModelArgs:
    dim: int = 16
    vocab_size: int = 97
    dtype: torch.dtype = torch.float32


class Transformer(torch.nn.Module):
    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(args.vocab_size, args.dim, dtype=args.dtype)
        self.layer = torch.nn.Linear(args.dim, args.dim, dtype=args.dtype)
        self.output = torch.nn.Linear(args.dim, args.vocab_size, bias=False, dtype=args.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layer(self.tok_embeddings(tokens)))
        return self.output(h)


llama3_args = {"debugmodel": TransformerModelArgs()}


def _unused(*args, **kwargs):
    raise NotImplementedError("not part of the stand-in")


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=Transformer, model_args=llama3_args, parallelize_fn=_unused,
        pipelining_fn=None, build_optimizers_fn=_unused, build_lr_schedulers_fn=_unused,
        build_dataloader_fn=_unused, build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss)
