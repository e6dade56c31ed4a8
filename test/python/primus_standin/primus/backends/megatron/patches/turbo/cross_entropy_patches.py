"""Stand-in of Primus-Turbo's cross-entropy patch of Megatron, written for cegen's tests.

It has the interface of the opt-in Turbo cross entropy that Primus registers for the same
two arguments cegen uses: patch id ``megatron.turbo.cross_entropy``, backend ``megatron``,
phase ``before_train``, default priority, condition ``use_turbo_cross_entropy``; its handler
replaces ``LanguageModule.compute_language_model_loss`` with a ``functools.wraps`` wrapper
of whatever is there, marked ``_primus_turbo_ce = True``, and returns at once if the method
in place already carries that mark. The wrapper computes TP = 1, bf16/fp32,
``cross_entropy_loss_fusion`` cases itself (here: PyTorch's cross entropy in fp32, counted
in ``CALLS``) and calls the wrapped function otherwise. Importing this module registers it.
"""

from functools import wraps

import torch

from primus.core.patches import PatchContext, get_args, register_patch

CALLS = {"turbo": 0}


def _enabled(ctx: PatchContext) -> bool:
    return bool(getattr(get_args(ctx), "use_turbo_cross_entropy", False))


@register_patch("megatron.turbo.cross_entropy", backend="megatron", phase="before_train",
                description="Primus-Turbo cross entropy (stand-in)", condition=_enabled)
def patch_cross_entropy(ctx: PatchContext) -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.compute_language_model_loss
    if getattr(original, "_primus_turbo_ce", False):
        return

    @wraps(original)
    def compute_language_model_loss(self, labels, logits):
        if (self.config.tensor_model_parallel_size != 1
                or logits.dtype not in (torch.bfloat16, torch.float32)
                or not self.config.cross_entropy_loss_fusion):
            return original(self, labels, logits)
        CALLS["turbo"] += 1
        target = labels.transpose(0, 1)
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        return loss.view(target.shape).transpose(0, 1).contiguous()

    compute_language_model_loss._primus_turbo_ce = True
    LanguageModule.compute_language_model_loss = compute_language_model_loss
