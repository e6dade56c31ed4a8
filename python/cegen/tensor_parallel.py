"""Vocab-parallel (tensor-parallel) softmax cross entropy: logits sharded over the vocabulary.

Under tensor parallelism each rank of a group of ``world`` ranks holds the logits of an
equal vocabulary slice, ``[..., V_local]`` with global ids ``[rank * V_local, (rank + 1) *
V_local)`` of a vocabulary of ``world * V_local`` ids (Megatron-Core's partitioning), and
every rank holds the same labels, global ids. One forward:

1. the ``shard_stats`` kernel reads the local slice once and writes four fp32 numbers per
   token: the slice's maximum ``m_r``, ``rest_r = sum_j exp(s (x_j - m_r)) - 1`` (the
   maximum's own 1 implicit; ``s`` the logit scale, 1 without one), the target logit if
   the label lies in the slice (else 0) and the slice's sum of logits (label smoothing
   only). The maximum, target and sum are of the unscaled logits x, exact: the combine
   scales them (its ``target - max`` subtracts before it multiplies by ``s``);
2. each rank writes them into its own slot of a zeroed ``[world, *tokens, 4]`` buffer and
   one ``all_reduce`` (SUM) hands every rank all slots: adding zeros is exact, so it is an
   all-gather that every backend (gloo, NCCL) runs with one collective;
3. :func:`combine_shard_stats` merges the slots elementwise into the per-token loss and
   log-sum-exp, exactly as the single-device kernel merges its lanes.

The backward kernel computes the local slice of the gradient from the combined ``lse``; it
needs no communication. A label in no slice (outside ``[0, vocab)``, not the ignore_index)
is reported as bad input by default; with ``label_out_of_range="megatron"`` the kernels
write target 0 for it, the combine takes the global maximum as its target and the
backward leaves out the one-hot term, which is Megatron-Core's vocab-parallel loss.
docs/tensor-parallel.md has the formulas and the reasons.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from . import _kernels, _validate
from ._kernels import KernelOptions, Shard
from ._errors import InvalidInputError
from ._outputs import CrossEntropyResult
from ._ownership import bump_version, grant_overwrite, is_compiling

__all__ = [
    "combine_shard_stats",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_vouched",
]

#: The lowest finite float32.
_F32_LOWEST = -3.4028234663852886e38

#: Per-token statistics in a shard_stats slot, in this order.
STATS_FIELDS = ("max", "rest", "target", "sum")
#: With the outputs (``with_outputs``), two more per slot: the slice's entropy and the
#: global id of its largest logit (as a float32: exact below 2^24 ids).
OUTPUT_FIELDS = ("entropy", "argmax")
#: The largest global vocabulary whose ids a float32 slot holds exactly.
_MAX_ARGMAX_VOCAB = 2 ** 24


def _smoothing_factor(label_smoothing: float, smoothing_vocab: int) -> float:
    """Megatron's ``s = alpha * V / (V - 1)``; 0 for a vocabulary of one."""
    if label_smoothing == 0.0 or smoothing_vocab <= 1:
        return 0.0
    return label_smoothing * smoothing_vocab / (smoothing_vocab - 1)


def combine_shard_stats(gathered: torch.Tensor, labels: torch.Tensor, *,
                        ignore_index: Optional[int], label_smoothing: float, z_loss: float,
                        vocab_local: int, vocab: int, global_smoothing: bool,
                        rank: int, label_out_of_range: str = "error",
                        with_low: bool = False,
                        logit_scale: float = 1.0,
                        with_outputs: bool = False) -> Tuple[torch.Tensor, ...]:
    """Per-token (loss, lse) from every rank's shard statistics; fp32, the labels' shape.
    With ``with_low``, (loss, lse, lse_low): ``lse + lse_low`` is ``M + log1p(rest)`` to
    twice f32's precision (the sharded backward's ``lse_low``, whose gradient's error then
    does not grow with the logits' magnitude). With ``with_outputs`` the slots hold six
    fields (``STATS_FIELDS + OUTPUT_FIELDS``: each slice's entropy and argmax too) and the
    entropy (fp32) and argmax (int64, a global id, -1 for a row with a NaN) of the whole
    vocabulary follow.

    Args:
        gathered: ``[world, *tokens, 4]``: slot ``r`` holds rank r's (max, rest, target,
            sum) of the ``shard_stats`` kernel.
        labels: global label ids, ``tokens`` shaped (only compared with ``ignore_index``
            and, under ``label_out_of_range="megatron"``, with ``[0, vocab)``).
        ignore_index: labels equal to it get loss 0; None: none.
        label_smoothing: alpha; ``s = alpha * V_s / (V_s - 1)`` with ``V_s = vocab_local``
            (Megatron-Core's tensor-parallel smoothing: each rank smooths towards the mean
            of its own slice, so the ranks' losses differ) or ``V_s = vocab`` with
            ``global_smoothing`` (the unsharded loss on every rank).
        z_loss: adds ``z_loss * lse^2``.
        vocab_local, vocab: the slice's and the whole vocabulary's size.
        rank: this rank's slot (whose slice mean local smoothing uses).
        label_out_of_range: ``"error"``: a label outside ``[0, vocab)`` that is not the
            ignore_index has a NaN target (the kernels report it), which propagates.
            ``"megatron"``: its target is the global maximum ``M`` (Megatron-Core's
            ``predicted_logits = 0`` in max-shifted coordinates), so its loss is
            ``log1p(rest) = lse - M`` before smoothing and z-loss.
        logit_scale: the ``s`` the statistics were computed with (``z = s x``): their
            ``rest`` is of z, their max, target and sum of x (the kernel's, unscaled); the
            loss and lse are of z. Statistics of a softcap kernel (``logit_softcap``) are
            all of ``z = cap tanh(s x / cap)`` already: combine them with 1.0.

    The merge keeps the single-device kernel's exact implicit one: with ``M = max_r m_r``,
    ``e_r = exp(m_r - M)`` and ``r*`` the rank holding ``M``,
    ``sum_j exp(x_j - M) = 1 + rest`` where ``rest = sum_r rest_r e_r + sum_{r != r*} e_r``;
    the 1 of ``r*`` is never added, so ``rest`` keeps its digits when ``p_y`` is near 1.
    ``lse = M + log1p(rest)``, ``loss = log1p(rest) - (x_y - M)``. Elementwise tensor
    operations only: no host synchronization; NaN (a bad label's target) propagates.
    With a logit scale ``s`` every difference of x is multiplied by ``s`` after the
    subtraction: ``e_r = exp(s (m_r - M))``, ``lse = s M + log1p(rest)`` (the product's own
    rounding in ``lse_low``), ``loss = log1p(rest) - s (x_y - M)``, the smoothing mean
    ``s mean``.
    """
    label_out_of_range = _validate.label_out_of_range(label_out_of_range)
    ignore_index = _validate.ignore_index(ignore_index)
    label_smoothing = _validate.label_smoothing(label_smoothing)
    z_loss = _validate.z_loss(z_loss)
    logit_scale = _validate.logit_scale(logit_scale)
    vocab = _validate.integer("vocab", vocab, 1)
    vocab_local = _validate.integer("vocab_local", vocab_local, 1, vocab)
    global_smoothing = _validate.flag("global_smoothing", global_smoothing)
    rank = _validate.integer("rank", rank)
    with_outputs = _validate.flag("with_outputs", with_outputs)
    fields = len(STATS_FIELDS) + (len(OUTPUT_FIELDS) if with_outputs else 0)
    if gathered.dim() < 2 or gathered.shape[-1] != fields:
        raise InvalidInputError(
            f"gathered shard statistics must be [world, *tokens, {fields}], got "
            f"{tuple(gathered.shape)}")
    tokens = tuple(gathered.shape[1:-1])
    if tuple(labels.shape) != tokens:
        raise InvalidInputError(
            f"labels of shape {tuple(labels.shape)} do not fit shard statistics of shape "
            f"{tuple(gathered.shape)}")
    world = gathered.shape[0]
    if not 0 <= rank < world:
        raise InvalidInputError(f"rank {rank} has no slot among {world}")
    stats = gathered.to(torch.float32)
    slice_max, slice_rest, slice_target, slice_sum = stats[..., :4].unbind(dim=-1)

    # Few elementwise kernels: on a GPU each costs a few microseconds whatever its size.
    top, top_rank = slice_max.max(dim=0)
    # The kernels floor a slice's maximum at -FLT_MAX; the floor here keeps an all -inf
    # token of other producers from computing -inf - -inf.
    shift = top.clamp(min=_F32_LOWEST)
    shifted = slice_max - shift
    if logit_scale != 1.0:
        shifted = shifted * logit_scale  # after the subtraction: exact near the maximum
    scale = torch.exp(shifted)  # exactly 1 in the slot r* holding the maximum
    below_top = scale.scatter(0, top_rank.unsqueeze(0), 0.0)  # the other slots' implicit 1s
    rest = torch.addcmul(below_top, slice_rest, scale).sum(dim=0)
    log1p_rest = torch.log1p(rest)
    # s M rounded once; its rounding error (exact: a product of two float32s is exact in
    # float64) joins lse_low.
    scaled_top = top * logit_scale if logit_scale != 1.0 else top
    lse = scaled_top + log1p_rest
    target = slice_target.sum(dim=0)  # one slot holds x_y, the others 0 (or all NaN)
    if label_out_of_range == "megatron":
        # Every slot wrote 0 for a label in no slice; Megatron-Core's target is the maximum.
        outside = (labels < 0) | (labels >= vocab)
        if ignore_index is not None:
            outside = outside & (labels != ignore_index)
        target = torch.where(outside, top, target)
    # -log p_y; x_y - M first: exact near the maximum, then scaled.
    target_shift = target - top
    if logit_scale != 1.0:
        target_shift = target_shift * logit_scale
    loss = log1p_rest - target_shift

    if label_smoothing != 0.0:
        if global_smoothing:
            smoothing_vocab, slice_total = vocab, slice_sum.sum(dim=0)
        else:
            smoothing_vocab, slice_total = vocab_local, slice_sum[rank]
        s = _smoothing_factor(label_smoothing, smoothing_vocab)
        if s != 0.0:
            mean = slice_total / smoothing_vocab
            if logit_scale != 1.0:
                mean = mean * logit_scale
            loss = (1.0 - s) * loss + s * (lse - mean)
    if z_loss != 0.0:
        loss = loss + z_loss * lse * lse
    if ignore_index is not None:
        loss = loss.masked_fill(labels == ignore_index, 0.0)
    results: Tuple[torch.Tensor, ...] = (loss, lse)
    if with_low:
        low = _sum_low(scaled_top, log1p_rest, lse)
        if logit_scale != 1.0:
            # The product's error, exact: s M is exact in float64, its float32 rounding too.
            product_error = (top.double() * logit_scale - scaled_top.double()).float()
            low = torch.where(torch.isfinite(lse), low + product_error, low)
        results += (low,)
    if with_outputs:
        results += _combine_outputs(stats, top, scale, slice_rest, rest, shifted,
                                    log1p_rest, lse)
    return results


def _combine_outputs(stats: torch.Tensor, top: torch.Tensor, scale: torch.Tensor,
                     slice_rest: torch.Tensor, rest: torch.Tensor, shifted: torch.Tensor,
                     log1p_rest: torch.Tensor, lse: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's (entropy, argmax) from the slices'.

    Slice r's softmax q_r, entropy H_r and log-sum-exp lse_r give the global p = q_r
    w_r with w_r = exp(lse_r - lse) = e_r (1 + rest_r) / (1 + rest), so
    ``H = sum_r w_r (H_r + lse - lse_r)``, every term non-negative (no cancellation),
    ``lse - lse_r = log1p(rest) - log1p(rest_r) - s (m_r - M)``; a slice without a logit
    above -inf (w_r = 0) adds nothing. The argmax is the lowest-ranked slice holding the
    maximum's own (slices are in id order), -1 if any slice has a NaN."""
    slice_entropy, slice_argmax = stats[..., 4], stats[..., 5]
    weight = scale * (1.0 + slice_rest) / (1.0 + rest)
    gap = log1p_rest - torch.log1p(slice_rest) - shifted
    terms = torch.where(weight > 0, weight * (slice_entropy + gap),
                        torch.zeros_like(weight))
    entropy = terms.sum(dim=0)
    entropy = torch.where(torch.isfinite(lse), entropy, torch.full_like(entropy, math.nan))
    # torch.argmax returns the first of equal values: the lowest rank holding M.
    first = (stats[..., 0] == top).to(torch.int8).argmax(dim=0)
    argmax = slice_argmax.gather(0, first.unsqueeze(0)).squeeze(0).to(torch.int64)
    has_nan = (slice_argmax < 0).any(dim=0)
    argmax = torch.where(has_nan, torch.full_like(argmax, -1), argmax)
    return entropy, argmax


def _sum_low(a: torch.Tensor, b: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The rounding error of the f32 sum ``total = a + b`` (Knuth's TwoSum, exact for any
    order of magnitude; 0 where the sum is not finite): ``a + b = total + low`` exactly."""
    b_part = total - a
    a_part = total - b_part
    low = (a - a_part) + (b - b_part)
    return torch.where(torch.isfinite(total), low, torch.zeros_like(low))


# -- the process group --------------------------------------------------------------------


def _rank_and_world(group: Any) -> Tuple[int, int]:
    """This process's rank in ``group`` and the group's size (0, 1 without distributed)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        if group is not None:
            raise InvalidInputError(
                "vocab_parallel_cross_entropy was given a process group but torch.distributed "
                "is not initialized")
        return 0, 1
    world = distributed.get_world_size(group=group)
    rank = distributed.get_rank(group=group)
    if rank < 0:
        raise InvalidInputError(
            "this process is not a member of the process group given to "
            "vocab_parallel_cross_entropy")
    return rank, world


def stats_slots(world: int, tokens: Tuple[int, ...], device: torch.device,
                outputs: bool = False) -> torch.Tensor:
    """The zeroed ``[world, *tokens, 4]`` fp32 buffer of every rank's shard statistics
    (``[..., 6]`` with ``outputs``: the slices' entropy and argmax too)."""
    fields = len(STATS_FIELDS) + (len(OUTPUT_FIELDS) if outputs else 0)
    return torch.zeros((world,) + tuple(tokens) + (fields,), dtype=torch.float32,
                       device=device)


def write_shard_stats(logits: torch.Tensor, labels: torch.Tensor, options: KernelOptions,
                      out: torch.Tensor) -> None:
    """This rank's statistics of ``logits`` (the slice ``options.shard``) into ``out``,
    its slot of :func:`stats_slots` (or a range of tokens of it); with six fields also
    the slice's entropy and argmax."""
    # z-loss is a function of the global lse: the combine adds it, the statistics do not.
    options = dataclasses.replace(options, z_loss=0.0)
    if out.shape[-1] == len(STATS_FIELDS):
        _kernels.shard_stats(logits, labels, options, out=out)
        return
    if options.shard.vocab > _MAX_ARGMAX_VOCAB:
        raise InvalidInputError(
            f"the argmax of a vocabulary of {options.shard.vocab} ids does not fit the "
            f"float32 statistics slot (at most {_MAX_ARGMAX_VOCAB} ids)")
    # Buffers of their own (the runtime refuses outputs whose memory ranges interleave),
    # copied into the slot: two token-sized copies.
    entropy = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    argmax = torch.empty(out.shape[:-1], dtype=torch.int64, device=out.device)
    _kernels.shard_stats(logits, labels, options, out=out[..., :len(STATS_FIELDS)],
                         entropy=entropy, argmax=argmax)
    out[..., len(STATS_FIELDS)].copy_(entropy)
    out[..., len(STATS_FIELDS) + 1].copy_(argmax)


def reduce_and_combine(gathered: torch.Tensor, labels: torch.Tensor, group: Any, rank: int,
                       world: int, options: KernelOptions,
                       vocab_local: int) -> Tuple[torch.Tensor, ...]:
    """The one all-reduce (SUM: every other slot is 0, so it is an all-gather) and the
    combine: (loss, lse, lse_low) of this rank from ``gathered`` with its own slot
    filled, and (entropy, argmax) after them when the slots have six fields."""
    if world > 1:
        torch.distributed.all_reduce(gathered, group=group)
    shard = options.shard
    return combine_shard_stats(
        gathered, labels, ignore_index=options.ignore_index,
        label_smoothing=options.label_smoothing, z_loss=options.z_loss,
        vocab_local=vocab_local, vocab=shard.vocab,
        global_smoothing=shard.global_smoothing, rank=rank,
        label_out_of_range=options.label_out_of_range, with_low=True,
        # A softcap kernel's statistics are of z itself (the scale is inside z).
        logit_scale=options.logit_scale if options.logit_softcap == 0.0 else 1.0,
        with_outputs=gathered.shape[-1] > len(STATS_FIELDS),
    )


def _sharded_forward(logits: torch.Tensor, labels: torch.Tensor, group: Any, rank: int,
                     world: int, options: KernelOptions, outputs: bool = False
                     ) -> Tuple[torch.Tensor, ...]:
    """(loss, lse, lse_low) of this rank, and (entropy, argmax) after them with
    ``outputs``: its shard statistics, one all-reduce, the combine."""
    gathered = stats_slots(world, tuple(labels.shape), logits.device, outputs)
    write_shard_stats(logits, labels, options, gathered[rank])
    return reduce_and_combine(gathered, labels, group, rank, world, options, logits.shape[-1])


class _VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Shard statistics + all-reduce + combine now; the local gradient slice in ``backward``.
    Returns the loss, or with ``outputs`` (loss, lse, entropy, argmax), only the loss
    differentiable."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                group: Any, rank: int, world: int, options: KernelOptions,
                overwrite: bool, outputs: bool = False) -> Any:
        results = _sharded_forward(logits, labels, group, rank, world, options, outputs)
        loss, lse, lse_low = results[:3]
        ctx.save_for_backward(logits, labels, lse, lse_low)
        ctx.options = options
        ctx.overwrite = overwrite
        if not outputs:
            return loss
        entropy, argmax = results[3:]
        ctx.mark_non_differentiable(lse, entropy, argmax)
        return loss, lse, entropy, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor,  # type: ignore[override]
                 *unused: Any) -> Tuple[Optional[torch.Tensor], ...]:
        logits, labels, lse, lse_low = ctx.saved_tensors
        if ctx.overwrite:
            _kernels.backward(logits, labels, lse, grad_loss, ctx.options, overwrite=True,
                              lse_low=lse_low)
            bump_version(logits)  # saved copies of the logits elsewhere now fail loudly
            grad = logits.detach()
        else:
            grad = _kernels.backward(logits, labels, lse, grad_loss, ctx.options,
                                     overwrite=False, lse_low=lse_low)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy_vouched(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    python_refs: int,
    vouched_refs: int,
    group: Any = None,
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    global_smoothing: bool = False,
    label_layout: str = "bs",
    overwrite_input: bool = False,
    label_out_of_range: str = "error",
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_lse: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
) -> Union[torch.Tensor, CrossEntropyResult]:
    """:func:`vocab_parallel_cross_entropy` for integrations that measured the logits'
    references themselves (see :func:`cegen.ops.cross_entropy_vouched`)."""
    options = KernelOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                            z_loss=z_loss, label_layout=label_layout,
                            label_out_of_range=label_out_of_range, logit_scale=logit_scale,
                            logit_softcap=_validate.logit_softcap(logit_softcap))
    overwrite_input = _validate.flag("overwrite_input", overwrite_input)
    global_smoothing = _validate.flag("global_smoothing", global_smoothing)
    returns = (_validate.flag("return_lse", return_lse),
               _validate.flag("return_entropy", return_entropy),
               _validate.flag("return_argmax", return_argmax))
    # The slices' entropy and argmax only where asked for (the lse is the combine's own).
    outputs = returns[1] or returns[2]
    _kernels.check_inputs(logits, labels, options)  # before any collective: every rank alike
    rank, world = _rank_and_world(group)
    vocab_local = logits.shape[-1]
    shard = Shard(start=rank * vocab_local, vocab=world * vocab_local,
                  global_smoothing=global_smoothing)
    options = dataclasses.replace(options, shard=shard)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if not needs_grad:
        results = _sharded_forward(logits, labels, group, rank, world, options, outputs)
        if not any(returns):
            return results[0]
        return _result(results[0], results[1], *(results[3:] if outputs else (None, None)),
                       returns=returns)
    overwrite = grant_overwrite(logits, overwrite_input, python_refs, vouched_refs, stacklevel=3)
    if not any(returns):
        return _VocabParallelCrossEntropyFunction.apply(logits, labels, group, rank, world,
                                                        options, overwrite)
    loss, lse, entropy, argmax = _VocabParallelCrossEntropyFunction.apply(
        logits, labels, group, rank, world, options, overwrite, True)
    return _result(loss, lse, entropy, argmax, returns=returns)


def _result(loss: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
            argmax: Optional[torch.Tensor], *,
            returns: Tuple[bool, bool, bool]) -> CrossEntropyResult:
    """The result with the outputs not asked for set to None."""
    return CrossEntropyResult(loss, lse if returns[0] else None,
                              entropy if returns[1] else None,
                              argmax if returns[2] else None)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: Any = None,
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    global_smoothing: bool = False,
    label_layout: str = "bs",
    overwrite_input: bool = False,
    label_out_of_range: str = "error",
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_lse: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
) -> Union[torch.Tensor, CrossEntropyResult]:
    """Per-token softmax cross entropy (fp32) of vocabulary-sharded logits.

    Every rank of ``group`` calls it with its slice of the logits and the same labels.

    Args:
        logits: this rank's vocabulary slice, ``[N, V_local]`` or ``[S, B, V_local]``
            (bfloat16, float16, float32; stride 1 over the vocabulary), holding the global
            ids ``[rank * V_local, (rank + 1) * V_local)`` of ``world * V_local`` (Megatron's
            equal partitions).
        labels: global ids, int64 or int32, ``[N]`` or ``[B, S]`` / ``[S, B]`` (see
            ``label_layout``); the same on every rank.
        group: the ``torch.distributed`` process group the vocabulary is split over (None:
            the default group; without an initialized torch.distributed, a group of one).
        ignore_index: labels equal to it get loss 0 and a zero gradient row.
        label_smoothing: alpha in [0, 1), Megatron's ``s = alpha V_s / (V_s - 1)``.
        z_loss: adds ``z_loss * lse^2`` per token (lse over the whole vocabulary).
        global_smoothing: ``V_s`` is the whole vocabulary (the loss equals the unsharded
            loss). The default, False, smooths as Megatron-Core's vocab-parallel cross
            entropy does: ``V_s = V_local`` and each rank's mean over its own slice, so with
            label smoothing the ranks' losses differ.
        label_layout: ``"bs"`` or ``"sb"`` for ``[S, B, V_local]`` logits.
        overwrite_input: write the gradient slice over the logits' storage when they are
            exclusively owned (as :func:`cegen.cross_entropy`).
        label_out_of_range: a label outside ``[0, world * V_local)`` that is not the
            ignore_index raises :class:`~cegen.LabelOutOfRangeError` on every rank (lazily
            on GPUs) with ``"error"``, the default; with ``"megatron"`` it gets
            Megatron-Core's vocab-parallel loss ``(1-s)(lse - max) + s(lse - mean) +
            z lse^2`` (max over the whole vocabulary) and the gradient slice
            ``g (p (1 + 2 z lse) - s/V_s)``, on every rank alike.
        logit_scale: every logit ``x`` is taken as ``z = logit_scale * x`` before the
            softmax, as in :func:`cegen.cross_entropy` (finite, > 0).
        logit_softcap: every logit is ``z = cap * tanh(logit_scale * x / cap)``, as in
            :func:`cegen.cross_entropy` (None: no cap); each slice's statistics are of z,
            the gradient slice goes through ``dz/dx``.
        return_lse, return_entropy, return_argmax: as in :func:`cegen.cross_entropy`,
            over the whole vocabulary: the argmax is a global id (each slice's entropy
            and best id travel in the same all-reduce, two more floats per token and
            rank; ids below 2^24).

    Returns:
        This rank's per-token loss, float32, in the labels' shape; with a ``return_*``
        flag a :class:`cegen.CrossEntropyResult`, the same on every rank.

    One all-reduce of ``world * tokens * 16`` bytes in the forward, none in the backward.
    Raises as :func:`cegen.cross_entropy`.
    """
    # First statement: see cegen._ownership.
    python_refs = 0 if is_compiling() else sys.getrefcount(logits)
    return vocab_parallel_cross_entropy_vouched(
        logits, labels, python_refs=python_refs, vouched_refs=0, group=group,
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        global_smoothing=global_smoothing, label_layout=label_layout,
        overwrite_input=overwrite_input, label_out_of_range=label_out_of_range,
        logit_scale=logit_scale, logit_softcap=logit_softcap, return_lse=return_lse,
        return_entropy=return_entropy, return_argmax=return_argmax,
    )
