"""``cegen.linear_cross_entropy``: the output projection and the loss together.

The logits ``hidden @ weight.T (+ bias)`` of a language model's output layer are its largest
activation (``[N, V]``: 2.1 GB in bf16 at 8192 tokens and V = 128256). Here they exist one
chunk of tokens at a time: per chunk the framework's GEMM (``torch.matmul``: cuBLAS, hipBLAS,
MKL) makes the chunk's logits, cegen's kernels compute the loss and write the gradient over
the chunk's own buffer, and two more GEMMs turn that gradient into the chunk's share of
``d hidden`` and ``d weight``. No GEMM of cegen's own, no ``[N, V]`` buffer.

Schedules (none of them reads a device value on the host):

* ``reduction="mean"`` or ``"sum"``: the function returns the reduced 0-d loss, whose
  upstream gradient is one number ``g``; the fused kernel computes the loss and the gradient
  with the reduction's weight (``1 / count`` of the tokens not ignored, or 1) in the
  forward, which also finishes ``d hidden`` and ``d weight``: three GEMMs in all, and the
  backward multiplies them by ``g`` on the device (cegen's rescale kernel: untouched when
  ``g`` is exactly 1, as ``loss.backward()`` gives; one pass over them otherwise).
* ``grad_weights`` given (the upstream gradient each token's loss will receive): the fused
  kernel runs in the forward with ``w'_t = w_t`` (1 where ``w_t = 0``), ``d hidden`` from
  that gradient and ``d weight`` from it with the rows of the zero-weight tokens left out.
  The backward reads no device value on the host: ``d hidden`` is rescaled on the device by
  ``g_t / w'_t`` per row (exact for any ``g``, zeros and zero weights included); ``d weight``
  (and ``d bias``) is the forward's when ``g`` is ``grad_weights``' own memory (same storage,
  strides and version), and is multiplied by ``g_0 / w'_0`` when both are broadcasts of one
  value (a number or 0-d ``grad_weights`` and a stride-0 ``g``, as ``loss.sum()`` gives).
  For any other ``g`` the device checks that ``g = r * grad_weights`` for one factor ``r``
  (every token with ``w_t != 0`` has ``g_t / w_t`` equal to ``r`` within 2^-20 relative, every
  token with ``w_t = 0`` has ``g_t = 0``: Megatron's ``loss_mask * c`` against the predicted
  ``loss_mask * c'``) and multiplies ``d weight`` by ``r`` where it holds, or by NaN where it
  does not, with a lazy :class:`~cegen._gradient_status.UnpredictedUpstreamError` (raised by
  the next cegen call, by :func:`cegen._gradient_status.check_fused_gradients`, or on the CPU
  by the backward itself): three GEMMs, never a silently wrong gradient. With
  ``grad_weights_exact=True`` such a ``g`` recomputes ``d weight`` (and ``d bias``) instead:
  each chunk's logits and the backward kernel with ``g``, two more GEMMs (five in all), right
  for any ``g``.
* otherwise the forward keeps only the per-token log-sum-exp, and the backward recomputes
  each chunk's logits (a fourth GEMM, as Cut Cross-Entropy does) and runs the backward kernel
  with the chunk's upstream gradient, stride-0 and zeros included.

Chunks (:func:`default_chunk_tokens`): at most 256 MiB of logits (and on a GPU at most a
quarter of the memory it can still hand out), the tokens split into equal chunks of a
multiple of 128 where the bytes allow (1024 tokens at V = 128256 in bf16).
d weight is written by the first chunk's GEMM and accumulated by the others (no zero fill);
the memory beyond the inputs is d hidden, d weight and one chunk of logits.

Vocabulary-parallel weights (``tp_group``): each rank holds its vocabulary slice of the
weight, ``[V_local, H]``, and the same hidden states and (global) labels. Per chunk the
slice's logits give the ``shard_stats`` kernel's statistics, which the single all-reduce of
:mod:`cegen.tensor_parallel` combines into the loss and log-sum-exp (the recompute schedule
gathers every chunk's statistics and all-reduces once); the sharded backward kernel writes
the slice's gradient ``G_r``. ``d weight`` (and ``d bias``) stay per rank; ``d hidden`` is
``sum_r G_r W_r``, one all-reduce in the backward, as Megatron's output layer
(ColumnParallelLinear) reduces its input gradient.

Not covered yet: sequence parallelism (hidden split over the sequence; the Megatron patch
all-gathers it first). The logit scale and softcap are the kernels' (``logit_scale``,
``logit_softcap``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from . import _gradient_status, _kernels, _validate
from ._errors import InvalidInputError
from ._kernels import KernelOptions, Shard
from ._log_once import LogOnce
from .tensor_parallel import (_rank_and_world, _sharded_forward, reduce_and_combine,
                              stats_slots, write_shard_stats)

__all__ = ["linear_cross_entropy", "default_chunk_tokens"]

GradWeights = Union[None, float, int, torch.Tensor]

#: Bytes of logits one chunk may hold by default: small next to the GEMMs' operands, large
#: enough that each GEMM of a chunk keeps the device busy (at V = 128256 in bf16, 1024 tokens).
DEFAULT_CHUNK_BYTES = 256 << 20


#: Chunks of at least this many tokens are made a multiple of it: the GEMMs' tiles (128 or
#: 256 rows on the H200's cuBLAS kernels) then have no ragged edge in the tokens' dimension.
CHUNK_ALIGN = 128

#: A default chunk's logits take at most 1 / FREE_SHARE of the memory the device can still
#: hand out (free memory plus what PyTorch's allocator holds unused): the rest is for the
#: GEMMs' workspaces, the kernels' per-token buffers and the caller's own tensors.
FREE_SHARE = 4


def available_bytes(device: torch.device) -> Optional[int]:
    """Bytes a CUDA/HIP device can still give PyTorch (free memory plus its allocator's
    unused reserve), None for the host or while a CUDA graph is being captured. Costs 0.2-0.5
    ms of host time on the H200 (``cudaMemGetInfo`` and the allocator's statistics), so the
    default chunk asks once per shape (:data:`_DEFAULT_CHUNKS`)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


#: The default chunk of each (device, tokens, vocabulary, element size) seen on a GPU, decided
#: by the first such call from the memory then available and kept: a training step's shapes
#: repeat, and the device query is not free. A call under graph capture takes the eager
#: call's decision (or, for a shape never run eagerly, the shapes alone).
_DEFAULT_CHUNKS: Dict[Tuple[str, int, int, int], int] = {}


def _default_chunk(num_tokens: int, vocab: int, element_bytes: int,
                   device: torch.device) -> int:
    key = (str(device), num_tokens, vocab, element_bytes)
    chunk = _DEFAULT_CHUNKS.get(key)
    if chunk is None:
        free = available_bytes(device)
        chunk = default_chunk_tokens(num_tokens, vocab, element_bytes, free_bytes=free)
        if free is not None:
            _DEFAULT_CHUNKS[key] = chunk
    return chunk


def default_chunk_tokens(num_tokens: int, vocab: int, element_bytes: int,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                         free_bytes: Optional[int] = None) -> int:
    """Tokens per chunk: at most as many as ``chunk_bytes`` of logits hold (at least 1), and
    with ``free_bytes`` (:func:`available_bytes`) at most 1 / :data:`FREE_SHARE` of it, the
    tokens split into equal chunks, each a multiple of :data:`CHUNK_ALIGN` where the bytes
    allow (8192 tokens at V = 128256 in bf16: 8 chunks of 1024, not 7 of 1046 and a last one
    of 870, whose GEMMs leave a tile row mostly empty)."""
    num_tokens = max(num_tokens, 1)
    per_token = max(1, vocab * element_bytes)
    if free_bytes is not None:
        chunk_bytes = min(chunk_bytes, max(0, free_bytes) // FREE_SHARE)
    cap = max(1, min(num_tokens, chunk_bytes // per_token))
    if cap >= num_tokens:
        return num_tokens
    count = -(-num_tokens // cap)
    even = -(-num_tokens // count)  # <= cap
    if cap < CHUNK_ALIGN:
        return even
    aligned = -(-even // CHUNK_ALIGN) * CHUNK_ALIGN
    if aligned <= cap:
        return aligned
    down = cap // CHUNK_ALIGN * CHUNK_ALIGN  # more chunks, each aligned: where not much smaller
    return down if 4 * down >= 3 * cap else even


def _chunks(num_tokens: int, chunk: int):
    for start in range(0, num_tokens, chunk):
        yield start, min(num_tokens, start + chunk)


def _logits_of(hidden: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """One chunk's logits, a fresh contiguous buffer the kernels may overwrite."""
    if bias is None:
        return torch.matmul(hidden, weight.t())
    return torch.addmm(bias, hidden, weight.t())


def _accumulate(grad_hidden: torch.Tensor, grad_weight: torch.Tensor,
                grad_bias: Optional[torch.Tensor], grad_logits: torch.Tensor,
                hidden: torch.Tensor, weight: torch.Tensor,
                keep: Optional[torch.Tensor] = None, first: bool = False) -> None:
    """``d hidden`` of the chunk (None: not wanted) and its share of ``d weight`` (and
    ``d bias``). ``keep``: a per-token 0/1 factor of the rows of ``d weight`` and
    ``d bias`` (the zero-weight tokens of the fused schedule left out). ``first``: the
    first chunk, whose GEMM writes ``d weight`` (not yet initialized: no zero fill, and no
    read of it in the GEMM's epilogue)."""
    if grad_hidden is not None:
        torch.matmul(grad_logits, weight, out=grad_hidden)
    rows = hidden if keep is None else hidden * keep[:, None]
    if first:
        torch.mm(grad_logits.t(), rows, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits.t(), rows)
    if grad_bias is not None:
        if keep is None:
            grad_bias.add_(grad_logits.sum(dim=0, dtype=torch.float32).to(grad_bias.dtype))
        else:
            grad_bias.add_(torch.mv(grad_logits.t(), keep))


def _uninitialized(like: torch.Tensor) -> torch.Tensor:
    """A buffer that the chunks write before anything reads it (tests poison it)."""
    return torch.empty_like(like)


def _zero_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                with_hidden: bool = True):
    """d hidden (written chunk by chunk; None without ``with_hidden``), d weight (written
    by the first chunk's GEMM: zeros only when there is no chunk) and d bias (zeros,
    accumulated)."""
    grad_hidden = _uninitialized(hidden) if with_hidden else None
    grad_weight = _uninitialized(weight) if hidden.shape[0] else torch.zeros_like(weight)
    grad_bias = None if bias is None else torch.zeros_like(bias)
    return grad_hidden, grad_weight, grad_bias


def _recompute_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     labels: torch.Tensor, lse: torch.Tensor, lse_low: torch.Tensor,
                     grad_loss: torch.Tensor, options: KernelOptions, chunk: int,
                     grad_hidden: Optional[torch.Tensor] = None):
    """The backward that recomputes each chunk's logits: correct for any ``grad_loss``.
    ``grad_hidden`` given (the fused schedule's, already rescaled): only ``d weight`` and
    ``d bias`` are recomputed (two GEMMs per chunk instead of three)."""
    own_hidden = grad_hidden is None
    made, grad_weight, grad_bias = _zero_grads(hidden, weight, bias, own_hidden)
    if own_hidden:
        grad_hidden = made
    for start, end in _chunks(hidden.shape[0], chunk):
        logits = _logits_of(hidden[start:end], weight, bias)
        _kernels.backward(logits, labels[start:end], lse[start:end], grad_loss[start:end],
                          options, overwrite=True, lse_low=lse_low[start:end])
        _accumulate(grad_hidden[start:end] if own_hidden else None, grad_weight, grad_bias,
                    logits, hidden[start:end], weight, first=start == 0)
        del logits  # released before the next chunk's: one chunk of logits at a time
    return grad_hidden, grad_weight, grad_bias


def _is_stride0(tensor: torch.Tensor) -> bool:
    """Every element is the one at the tensor's offset (a broadcast of one value)."""
    return tensor.numel() > 0 and all(stride == 0 for stride in tensor.stride())


#: How far a token's ``g_t / w_t`` may be from the common factor ``r`` (relative): the
#: rounding of two products ``m_t * c`` and ``m_t * c'`` with a loss mask ``m_t`` that is
#: not 0 or 1 (a few float32 ulps, 2^-23 each). Scaling that token's share of ``d weight``
#: by ``r`` instead errs by less than this, far below the float32 GEMM's own rounding.
RATIO_TOLERANCE = 2.0 ** -20


def _common_factor(grad_loss: torch.Tensor, weights: torch.Tensor,
                   ratio: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(factor, bad) on the device, read by nobody on the host: ``factor`` is ``r``
    where ``g = r * grad_weights`` holds for every token, NaN where it does not; ``bad``
    marks the tokens where it does not (only counted when ``g`` is finite: a NaN or inf
    upstream makes every gradient NaN anyway). ``ratio``: ``g_t / w'_t``, float32 ``[N]``;
    ``weights``: ``grad_weights``, 0-d (every token's kernel weight was that number, or 1
    for 0) or ``[N]`` (a zero-weight token's rows are not in d weight: its ``g_t`` must be 0).
    """
    g = grad_loss.float()
    if weights.dim() == 0:  # no row left out: every token's g_t / w'_t must be r
        reference = ratio[:1]
        counted = None
    else:
        counted = weights != 0
        # The first token with a non-zero weight (argmax: no nonzero(), no host read); with
        # none, token 0, whose ratio is its g (w' = 1), which must then be 0.
        first = torch.argmax(counted.to(torch.uint8)).reshape(1)
        reference = torch.index_select(ratio, 0, first)
    close = (ratio - reference).abs() <= RATIO_TOLERANCE * reference.abs()
    matches = close if counted is None else torch.where(counted, close, g == 0)
    uniform = matches.all()
    factor = torch.where(uniform, reference.reshape(()),
                         torch.full((), float("nan"), dtype=torch.float32, device=g.device))
    return factor, ~matches & torch.isfinite(g).all()


def _same_memory(grad: torch.Tensor, weights: torch.Tensor, version: int) -> bool:
    """``grad`` is ``weights`` itself: the same storage, offset, shape, strides and dtype,
    not written since the forward (metadata only, no device read)."""
    return (grad.dtype == weights.dtype and grad.device == weights.device
            and grad.shape == weights.shape and grad.stride() == weights.stride()
            and grad.data_ptr() == weights.data_ptr() and weights._version == version)


@dataclasses.dataclass(frozen=True)
class _VocabParallel:
    """This rank's place in the tensor-parallel group the weight's vocabulary is split over."""

    group: Any
    rank: int
    world: int
    #: Sum d hidden over the ranks (False: the caller reduces it, e.g. a reduce-scatter).
    reduce_grad_hidden: bool = True


def _sharded_lse(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 labels: torch.Tensor, options: KernelOptions, chunk: int,
                 tp: _VocabParallel) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse, lse_low) of every token from the slice's statistics, chunk by chunk, and one
    all-reduce for all of them (the schedule whose backward recomputes)."""
    gathered = stats_slots(tp.world, (hidden.shape[0],), hidden.device)
    for start, end in _chunks(hidden.shape[0], chunk):
        logits = _logits_of(hidden[start:end], weight, bias)
        write_shard_stats(logits, labels[start:end], options, gathered[tp.rank, start:end])
        del logits
    return reduce_and_combine(gathered, labels, tp.group, tp.rank, tp.world, options,
                              weight.shape[0])


def _reduction_weight(labels: torch.Tensor, options: KernelOptions, reduction: str,
                      device: torch.device) -> torch.Tensor:
    """The 0-d weight of every token's loss in a reduced loss: 1 for a sum, ``1 / count``
    of the tokens not ignored (at least 1) for a mean, made on the device."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if options.ignore_index is None:
        return torch.full((), 1.0 / max(1, labels.numel()), dtype=torch.float32, device=device)
    return 1.0 / (labels != options.ignore_index).sum().clamp(min=1).float()


class _LinearCrossEntropy(torch.autograd.Function):
    """Rows of ``hidden`` ``[N, H]``, ``weight`` ``[V, H]`` (a vocabulary slice with
    ``tp``), row labels ``[N]``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: Optional[torch.Tensor], labels: torch.Tensor,
                weights: Optional[torch.Tensor], options: KernelOptions,
                chunk: int, tp: Optional[_VocabParallel], reduction: str,
                exact: bool) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        needs_grad = any(ctx.needs_input_grad[:3])
        if reduction != "none":
            weights = _reduction_weight(labels, options, reduction, hidden.device)
        fused = needs_grad and weights is not None
        ctx.options, ctx.chunk, ctx.tp, ctx.grads = options, chunk, tp, None
        ctx.reduction, ctx.exact = reduction, exact
        ctx.weights_version = None if weights is None else weights._version
        if tp is not None and not fused:
            loss, lse, lse_low = _sharded_lse(hidden, weight, bias, labels, options, chunk, tp)
            ctx.save_for_backward(hidden, weight, bias, labels, lse, lse_low, None, None)
            return _reduced(loss, weights, reduction)
        loss = torch.empty((num_tokens,), dtype=torch.float32, device=hidden.device)
        lse = torch.empty((num_tokens,), dtype=torch.float32, device=hidden.device)
        # lse's low part: a recomputing backward's gradient is then exact at any |logits|.
        lse_low = torch.empty_like(lse)
        kernel_weights = keep = None
        if fused:
            grads = _zero_grads(hidden, weight, bias)
            # The kernel's weight: 1 where grad_weights is 0, so that every token's gradient
            # row exists and the backward can rescale d hidden by g / w' for any g; the
            # zero-weight tokens' rows are left out of d weight and d bias (keep).
            kernel_weights = torch.where(weights == 0, torch.ones_like(weights), weights)
            if weights.dim() == 1:
                keep = (weights != 0).to(hidden.dtype)
        for start, end in _chunks(num_tokens, chunk):
            logits = _logits_of(hidden[start:end], weight, bias)
            if fused:
                chunk_weights = (kernel_weights if kernel_weights.dim() == 0
                                 else kernel_weights[start:end])
                if tp is None:
                    loss_c, lse_c, _, low_c = _kernels.fused(
                        logits, labels[start:end], chunk_weights, options, overwrite=True,
                        low=True)
                else:  # the statistics' all-reduce first: the gradient needs the global lse
                    loss_c, lse_c, low_c = _sharded_forward(
                        logits, labels[start:end], tp.group, tp.rank, tp.world, options)
                    _kernels.backward(logits, labels[start:end], lse_c,
                                      chunk_weights.expand(end - start), options,
                                      overwrite=True, lse_low=low_c)
                _accumulate(grads[0][start:end], grads[1], grads[2], logits,
                            hidden[start:end], weight,
                            None if keep is None else keep[start:end], first=start == 0)
            else:
                loss_c, lse_c, low_c = _kernels.forward(logits, labels[start:end], options,
                                                        low=True)
            loss[start:end] = loss_c
            lse[start:end] = lse_c
            lse_low[start:end] = low_c
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, lse, lse_low, weights,
                              kernel_weights)
        # Not saved tensors: the backward hands them on (or drops them) and releases them,
        # so that they do not live on with the graph; a second backward of a retained graph
        # recomputes.
        ctx.grads = grads if fused else None
        return _reduced(loss, weights, reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        hidden, weight, bias, labels, lse, lse_low, weights, kernel_weights = ctx.saved_tensors
        if ctx.reduction != "none":
            # Every token's upstream gradient is grad_out * weights (weights: the
            # reduction's 0-d weight); stride 0, as loss.sum()'s.
            grad_loss = (grad_out.float() * weights).expand(hidden.shape[0])
        else:
            grad_loss = grad_out
        if ctx.grads is not None:  # handed on and released by _finish_fused
            grads = _finish_fused(ctx, grad_out, grad_loss, hidden, weight, bias, labels, lse,
                                  lse_low,
                                  weights, kernel_weights)
        else:
            grads = _recompute_grads(hidden, weight, bias, labels, lse, lse_low,
                                     grad_loss.float(),
                                     ctx.options, ctx.chunk)
        if ctx.tp is not None and ctx.tp.reduce_grad_hidden and ctx.needs_input_grad[0]:
            # Every rank reduces once per backward, whichever branch it took: d hidden is
            # this rank's share sum_t G_r W_r until it is summed over the ranks.
            torch.distributed.all_reduce(grads[0], group=ctx.tp.group)
        return grads[0], grads[1], grads[2], None, None, None, None, None, None, None


def _reduced(loss: torch.Tensor, weights: Optional[torch.Tensor],
             reduction: str) -> torch.Tensor:
    """The per-token loss, or its weighted sum (mean: weights = 1 / count)."""
    if reduction == "none":
        return loss
    return (loss.sum() * weights).reshape(())


def _finish_fused(ctx: Any, grad_out: torch.Tensor, grad_loss: torch.Tensor,
                  hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  labels: torch.Tensor, lse: torch.Tensor, lse_low: torch.Tensor,
                  weights: torch.Tensor,
                  kernel_weights: torch.Tensor):
    """The forward's gradients ``ctx.grads`` (for the upstream ``kernel_weights``, the
    zero-weight tokens left out of d weight and d bias), taken from ``ctx``, turned into
    those of ``grad_loss`` without reading a device value: see the module's docstring.
    Every scaling is :func:`_scale_rows`: rows whose factor is exactly 1 are not touched
    (``loss.backward()`` of a mean, a prediction that was right), others are read and
    written once."""
    # Only these names hold them now, so that a recompute can release d weight first.
    grad_hidden, grad_weight, grad_bias = ctx.grads
    ctx.grads = None
    bundle = ctx.options.bundle
    if ctx.reduction != "none" or (kernel_weights.dim() == 0 and _is_stride0(grad_loss)):
        # One value for every token on both sides: every gradient is scaled by g_0 / w'_0
        # (a reduction's: by its upstream gradient, the forward's weight being its own).
        if ctx.reduction != "none":
            numerator, denominator = grad_out.float().reshape(()), _one(grad_out.device)
        else:
            numerator, denominator = grad_loss.reshape(-1)[0].float(), kernel_weights
        for grad in (grad_hidden, grad_weight, grad_bias):
            if grad is not None:
                _scale_rows(grad, denominator, numerator, bundle)
        return grad_hidden, grad_weight, grad_bias
    # d hidden's row t is w'_t d_t W: g_t / w'_t makes it g_t d_t W, for any g_t.
    _scale_rows(grad_hidden, kernel_weights, grad_loss.float(), bundle)
    if weights.dim() == 1 and _same_memory(grad_loss, weights, ctx.weights_version):
        return grad_hidden, grad_weight, grad_bias  # g is grad_weights: d weight is the answer
    if ctx.exact:  # right for any g: d weight and d bias from g itself
        del grad_weight, grad_bias  # released before the recompute allocates its own
        return _recompute_grads(hidden, weight, bias, labels, lse, lse_low, grad_loss.float(),
                                ctx.options, ctx.chunk, grad_hidden=grad_hidden)
    if grad_loss.numel() == 0:
        return grad_hidden, grad_weight, grad_bias  # no token: nothing to scale
    # g = r * grad_weights, checked on the device: d weight (a sum over the tokens) is r times
    # the forward's; where it is not, NaN and a lazy error (no host read to choose otherwise).
    ratio = grad_loss.float() / kernel_weights
    factor, bad = _common_factor(grad_loss, weights, ratio)
    for grad in (grad_weight, grad_bias):
        if grad is not None:
            _scale_rows(grad, _one(grad.device), factor, bundle)
    _gradient_status.record(bad, _gradient_status.LINEAR_UPSTREAM)  # on the CPU: may raise
    return grad_hidden, grad_weight, grad_bias


def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


#: Elements per row that :func:`_scale_rows` gives the rescale kernel for a contiguous
#: gradient at most (d weight as rows of this many elements, not of H: fewer rows to
#: visit where the factor is 1).
SCALE_ROW_ELEMENTS = 1 << 16

# (dtype, device, bundle, bundle cache generation) -> (bundle, ce_options) of the rescale
# kernel, or None where there is none (then PyTorch's operations scale).
_rescale_found: Dict[Tuple[Any, ...], Optional[Tuple[Any, Any]]] = {}
_rescale_lock = threading.Lock()
_fallbacks = LogOnce(logging.getLogger("cegen"))


def _rescale_kernel(grad: torch.Tensor, bundle: Optional[str]) -> Optional[Tuple[Any, Any]]:
    """cegen's ``rescale`` kernel for ``grad``'s dtype and device (``[N, V]`` rows): from
    ``bundle`` when it holds one, else where the fused path's correction finds it."""
    from . import _bundle_cache
    from ._runtime import get_runtime
    from ._variant import rescale_key

    where = (grad.dtype, grad.device, bundle, _bundle_cache.generation)
    if where in _rescale_found:
        return _rescale_found[where]
    found: Optional[Tuple[Any, Any]] = None
    if grad.dtype in _kernels._LOGITS_DTYPES:
        try:
            runtime = get_runtime()
            if not runtime.has_rescale():
                raise RuntimeError(f"the runtime library {runtime.path} has no ce_rescale")
            key = rescale_key(_kernels._LOGITS_DTYPES[grad.dtype][0], "flat")
            target = _kernels.device_target(grad.device)
            opened = None
            if bundle is not None:
                try:
                    opened = _bundle_cache.bundle_for(key, bundle, target)
                except Exception:  # noqa: BLE001  (not in this bundle: the usual places)
                    opened = None
            if opened is None:
                opened = _bundle_cache.bundle_for(key, None, target)
            found = (opened, runtime.default_options())
        except Exception as error:  # noqa: BLE001  (no kernel: PyTorch scales the same rows)
            if grad.device.type != "cpu":
                _fallbacks.warn("cegen.linear_cross_entropy: its gradients are scaled by "
                                "PyTorch operations (a full pass, also for a factor of 1): %s",
                                f"no rescale kernel for {grad.dtype} on {grad.device}: {error}")
    with _rescale_lock:
        _rescale_found[where] = found
    return found


def _scale_rows(grad: torch.Tensor, weights: torch.Tensor, grad_loss: torch.Tensor,
                bundle: Optional[str]) -> None:
    """In place, no host read: row t of ``grad`` times ``grad_loss[t] / weights[t]`` (f32;
    0 where ``grad_loss[t]`` is 0), rows where the two are equal left as they are.
    ``grad``: ``[N, ...]`` rows (d hidden) or any gradient when ``grad_loss`` is 0-d (one
    factor for every element: d weight, d bias); ``weights``: 0-d or ``[N]``, never 0
    where ``grad_loss`` is not. By cegen's rescale kernel where there is one: a factor of
    exactly 1 costs a read of two floats per row; else by PyTorch's operations (one pass,
    a 0-d factor rounded to the gradient's dtype, so that the pass is in one dtype, which
    PyTorch vectorizes: its rounding, 2^-9 relative in bf16, none for 1 or a power of
    two, adds to the element's)."""
    if grad.numel() == 0:
        return
    if grad_loss.dim() == 0 and grad.is_contiguous():
        width = grad.numel()
        while width > SCALE_ROW_ELEMENTS and width % 2 == 0:
            width //= 2
        rows = grad.view(-1, width)
    else:
        rows = grad.reshape(grad.shape[0], -1) if grad.dim() > 0 else grad.view(1, 1)
    if rows.data_ptr() != grad.data_ptr() or (rows.shape[1] > 1 and rows.stride(1) != 1):
        rows = None  # a copy (reshape of a gradient it cannot view), or strided elements
    elif grad_loss.dim() == 0:
        grad_loss = grad_loss.expand(rows.shape[0])
    found = None if rows is None else _rescale_kernel(grad, bundle)
    if found is not None:
        from ._runtime import get_runtime

        kernel_bundle, options = found
        get_runtime().rescale(kernel_bundle, options, _kernels.describe(rows, "scaled grad"),
                              _kernels.describe(weights, "scale weights"),
                              _kernels.describe(grad_loss, "scale grad_loss"),
                              _kernels._stream(grad.device))
        return
    if grad_loss.dim() == 1 and weights.dim() == 0 and _is_stride0(grad_loss):
        grad_loss = grad_loss[0]  # one factor (d weight's): the pass in the gradient's dtype
    ratio = torch.where(grad_loss != 0, grad_loss / weights, torch.zeros_like(grad_loss))
    if ratio.dim() == 0:
        grad.mul_(ratio.to(grad.dtype))
    else:
        grad.mul_(ratio.reshape((-1,) + (1,) * (grad.dim() - 1)))


def _row_labels(labels: torch.Tensor, hidden_shape: Tuple[int, ...],
                label_layout: str) -> torch.Tensor:
    """Labels in the rows' order (token t = s * B + b for ``[S, B, H]`` hidden)."""
    if len(hidden_shape) == 2:
        expected = (hidden_shape[0],)
        rows = labels
    else:
        seq, batch = hidden_shape[0], hidden_shape[1]
        expected = (batch, seq) if label_layout == "bs" else (seq, batch)
        rows = labels.transpose(0, 1) if label_layout == "bs" else labels
    if tuple(labels.shape) != expected:
        raise InvalidInputError(
            f"labels of shape {tuple(labels.shape)} do not fit hidden {tuple(hidden_shape)}: "
            f"expected {list(expected)}"
            + ("" if len(hidden_shape) == 2 else f" (label_layout={label_layout!r})"))
    return rows.reshape(-1).contiguous()


def _row_weights(grad_weights: GradWeights, hidden: torch.Tensor, hidden_shape,
                 label_layout: str) -> Optional[torch.Tensor]:
    if grad_weights is None:
        return None
    if not (isinstance(grad_weights, torch.Tensor) and grad_weights.is_floating_point()):
        if not isinstance(grad_weights, torch.Tensor) or grad_weights.dim() == 0:
            weight = _validate.scalar_grad_weight(grad_weights)
            # torch.full, not torch.tensor: no blocking host-to-device copy
            return torch.full((), weight, dtype=torch.float32, device=hidden.device)
        raise InvalidInputError(f"grad_weights must be floating point, got {grad_weights.dtype}")
    if grad_weights.device != hidden.device:
        raise InvalidInputError(
            f"grad_weights are on {grad_weights.device} but hidden is on {hidden.device}")
    weights = grad_weights.detach()
    if weights.dim() == 0:
        return weights.float()
    rows = _row_labels(weights, hidden_shape, label_layout).float()
    if _is_stride0(weights):
        # One value broadcast (e.g. expand of a 0-d tensor): kept 0-d, so that a stride-0
        # upstream gradient scales the forward's gradients instead of recomputing them.
        return weights.as_strided((), (), weights.storage_offset()).float()
    return rows


def _vocab_parallel(group: Any, vocab_start: Any, vocab_size: Any, global_smoothing: Any,
                    reduce_grad_hidden: Any, vocab_local: int,
                    ) -> Tuple[Optional[_VocabParallel], Optional[Shard]]:
    """This rank's place and vocabulary slice, or (None, None) without tensor parallelism."""
    vocab_start = _validate.integer("vocab_start", vocab_start, 0, allow_none=True)
    vocab_size = _validate.integer("vocab_size", vocab_size, 1, allow_none=True)
    global_smoothing = _validate.flag("global_smoothing", global_smoothing)
    reduce_grad_hidden = _validate.flag("reduce_grad_hidden", reduce_grad_hidden)
    if (vocab_start is None) != (vocab_size is None):
        raise InvalidInputError("give both vocab_start and vocab_size, or neither")
    if group is None:
        if vocab_start is not None:
            raise InvalidInputError(
                "vocab_start and vocab_size describe a slice of the vocabulary split over "
                "tp_group, and no tp_group was given")
        return None, None
    rank, world = _rank_and_world(group)
    if vocab_start is None:
        vocab_start, vocab_size = rank * vocab_local, world * vocab_local
    if vocab_start + vocab_local > vocab_size:
        raise InvalidInputError(
            f"the weight's slice [{vocab_start}, {vocab_start} + {vocab_local}) exceeds the "
            f"vocabulary of {vocab_size}")
    if world == 1 and vocab_size == vocab_local:
        return None, None  # the whole vocabulary: the kernels of one device
    shard = Shard(start=vocab_start, vocab=vocab_size, global_smoothing=global_smoothing)
    return _VocabParallel(group, rank, world, reduce_grad_hidden), shard


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    label_layout: str = "bs",
    grad_weights: GradWeights = None,
    grad_weights_exact: bool = False,
    chunk_tokens: Optional[int] = None,
    bundle: Union[None, str, "os.PathLike[str]"] = None,
    label_out_of_range: str = "error",
    tp_group: Any = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    global_smoothing: bool = False,
    reduce_grad_hidden: bool = True,
    reduction: str = "none",
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """Per-token cross entropy (fp32) of the logits ``hidden @ weight.T + bias``, computed a
    chunk of tokens at a time so that the ``[N, V]`` logits never exist in full.

    Args:
        hidden: ``[N, H]`` or Megatron's ``[S, B, H]`` (bf16, fp16, fp32).
        weight: ``[V, H]``, the output layer's weight, the same dtype and device.
        labels: as for :func:`cegen.cross_entropy`: ``[N]``, or ``[B, S]`` / ``[S, B]``
            (``label_layout``) for ``[S, B, H]`` hidden.
        bias: optional ``[V]``.
        ignore_index, label_smoothing, z_loss, label_out_of_range: as for
            :func:`cegen.cross_entropy`.
        grad_weights: the upstream gradient each token's loss will receive (a number, or a
            tensor of the labels' shape), known now up to one common factor: the forward
            then finishes the gradients (three GEMMs). The backward uses them as they are
            when the upstream gradient is this tensor itself (``loss.backward(grad_weights)``),
            and otherwise scales them by the factor ``r`` in ``g = r * grad_weights``, found
            and checked on the device (a zero weight needs a zero ``g``); ``d hidden`` is
            rescaled per token and is right for any ``g``. Where ``g`` is not
            ``r * grad_weights``, ``d weight`` and ``d bias`` are NaN and an
            :class:`~cegen._gradient_status.UnpredictedUpstreamError` is raised by the next
            cegen call (on the CPU by the backward). Never reads a device value on the host.
            With ``reduction="none"`` only.
        grad_weights_exact: what the backward does when the upstream gradient is neither
            ``grad_weights``' own tensor nor a broadcast meeting a number. False (the
            default): the check above, three GEMMs in all. True: ``d weight`` (and
            ``d bias``) are recomputed from ``g`` (each chunk's logits again, two more
            GEMMs: five, one more than without ``grad_weights``), right for any ``g``. The
            default serves what ``grad_weights`` is for: a caller who knows the upstream
            gradient (up to a loss scale, a token count, a number of micro-batches, as
            Megatron's training step) gets three GEMMs and a loud error, never a wrong
            gradient, if it was wrong; a caller who does not know it is faster without
            ``grad_weights`` (four GEMMs) than with the exact recompute (five), which is for
            callers whose prediction is usually the upstream's own tensor and who must
            never fail otherwise.
        chunk_tokens: tokens per chunk (default: :func:`default_chunk_tokens`, at most
            256 MiB of logits and, on a GPU, a quarter of the memory it can still hand out,
            in equal chunks).
        bundle: a bundle directory (or :class:`cegen.Bundle`) to take the kernels from
            (default: the cache).
        tp_group: the ``torch.distributed`` process group the vocabulary is split over
            (None, the default: ``weight`` holds the whole vocabulary, no collective). Every
            rank of the group calls with the same ``hidden``, labels (global ids) and
            options, and its slice of ``weight`` (and ``bias``): the loss is
            :func:`cegen.vocab_parallel_cross_entropy`'s of the slice's logits, ``d hidden``
            is summed over the ranks (one all-reduce in the backward) and ``d weight`` is the
            rank's slice's.
        vocab_start, vocab_size: with ``tp_group``, the slice's first global id and the
            whole vocabulary; by default equal slices, ``rank * V_local`` of
            ``world * V_local`` (Megatron's). Give both for slices of unequal sizes.
        global_smoothing: with ``tp_group`` and label smoothing, smooth over the whole
            vocabulary (the loss of the unsharded weight). The default, False, is
            Megatron-Core's tensor-parallel smoothing (each rank towards its own slice's
            mean, as :func:`cegen.vocab_parallel_cross_entropy`).
        reduce_grad_hidden: with ``tp_group``, all-reduce ``d hidden`` over the group (the
            default, as Megatron's output layer without sequence parallelism). False returns
            each rank's share ``G_r W_r``, for a caller that sums it itself (sequence
            parallelism: the backward of the all-gather of ``hidden`` is a reduce-scatter).
        reduction: ``"none"`` (the per-token loss), ``"sum"`` or ``"mean"`` (over the
            tokens whose label is not ``ignore_index``, at least 1: 0 when every token is
            ignored, where F.cross_entropy gives NaN). A reduced loss's gradients are
            finished in the forward (three GEMMs) and multiplied by its upstream gradient
            in the backward.
        logit_scale: every logit ``x`` is taken as ``z = logit_scale * x`` before the
            softmax, as in :func:`cegen.cross_entropy` (finite, > 0; flash-attention's and
            output multipliers' scale, applied in the kernels, not as another GEMM
            epilogue); the gradients are of the unscaled logits' GEMMs.
        logit_softcap: every logit is ``z = cap * tanh(logit_scale * x / cap)`` (Gemma's
            final softcap, applied in the kernels), as in :func:`cegen.cross_entropy`
            (None: no cap); the kernels' chunk gradients go through ``dz/dx``.

    Returns:
        The per-token loss, float32, in the labels' shape (a 0-d tensor with a
        reduction); differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    """
    for name, tensor in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if hidden.dim() not in (2, 3):
        raise InvalidInputError(f"hidden must be [N, H] or [S, B, H], got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InvalidInputError(
            f"weight must be [V, H] with H = {hidden.shape[-1]}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise InvalidInputError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, "
            f"{hidden.device})")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != hidden.dtype
                             or bias.device != hidden.device):
        raise InvalidInputError(
            f"bias must be [V] = [{weight.shape[0]}] of {hidden.dtype} on {hidden.device}, got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
    chunk_tokens = _validate.integer("chunk_tokens", chunk_tokens, 1, allow_none=True)
    options = KernelOptions(ignore_index, label_smoothing, z_loss, "bs",
                            _validate.bundle(bundle), label_out_of_range=label_out_of_range,
                            logit_scale=logit_scale,
                            logit_softcap=_validate.logit_softcap(logit_softcap))
    tp, shard = _vocab_parallel(tp_group, vocab_start, vocab_size, global_smoothing,
                                reduce_grad_hidden, weight.shape[0])
    if shard is not None:
        options = dataclasses.replace(options, shard=shard)
    label_layout = _validate.label_layout(label_layout)
    hidden_shape = tuple(hidden.shape)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    row_labels = _row_labels(labels, hidden_shape, label_layout)
    if reduction not in ("none", "mean", "sum"):
        raise InvalidInputError(
            f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if reduction != "none" and grad_weights is not None:
        raise InvalidInputError(
            f"grad_weights is for reduction='none' (reduction={reduction!r} weighs every "
            "token itself)")
    grad_weights_exact = _validate.flag("grad_weights_exact", grad_weights_exact)
    weights = _row_weights(grad_weights, hidden, hidden_shape, label_layout)
    chunk = chunk_tokens or _default_chunk(rows.shape[0], weight.shape[0],
                                           hidden.element_size(), hidden.device)
    loss = _LinearCrossEntropy.apply(rows, weight, bias, row_labels, weights, options, chunk,
                                     tp, reduction, grad_weights_exact)
    if len(hidden_shape) == 3 and reduction == "none":
        loss = loss.view(hidden_shape[0], hidden_shape[1])  # [S, B]
        if label_layout == "bs":
            loss = loss.t().contiguous()
    return loss
