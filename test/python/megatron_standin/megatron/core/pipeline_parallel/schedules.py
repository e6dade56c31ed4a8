"""Stand-in of the two steps of Megatron-Core's ``pipeline_parallel/schedules.py`` that act
on the loss of the last pipeline stage, for cegen's tests.

As in Megatron-Core (commit d98e8a64 of NVIDIA/Megatron-LM, read for issue 16):

* ``forward_step_calc_loss``: ``loss_func(output_tensor)`` returns (loss, num_tokens,
  report); unless ``config.calculate_per_token_loss`` the loss is divided in place by
  ``torch.clamp(num_tokens, min=1)`` and then by the number of micro-batches; a loss_func
  that returns two values has its loss divided by the number of micro-batches only;
* ``backward_step`` (last stage, no output gradient): the loss goes through
  ``config.grad_scale_func`` (the optimizer's ``scale_loss``: ``loss_scale * loss``), then
  ``torch.autograd.backward`` with the implicit gradient 1.
"""

import torch


def forward_step_calc_loss(output_tensor, loss_func, config, num_microbatches):  # type: ignore[no-untyped-def]
    num_tokens = torch.tensor(0, dtype=torch.int)
    outputs = loss_func(output_tensor)
    if len(outputs) == 3:
        output_tensor, num_tokens, _ = outputs
        if not config.calculate_per_token_loss:
            output_tensor /= torch.clamp(num_tokens, min=1)
            output_tensor /= num_microbatches
    else:
        output_tensor, _ = outputs
        output_tensor /= num_microbatches
    return output_tensor, num_tokens


def backward_step(output_tensor, config):  # type: ignore[no-untyped-def]
    if config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    torch.autograd.backward(output_tensor, grad_tensors=None)
