"""Lazy reports of fused gradients that could not be made right, without a host sync.

The fused path (``grad_weights=``) computes ``w_t * dloss_t/dlogits`` in the forward; its
backward rescales each row by ``g_t / w_t`` on the device (``cegen._rescale``). A token
whose weight was 0 has no gradient to rescale: if its upstream gradient ``g_t`` is not 0,
its gradient row is set to NaN and the token is counted here. The count is read by the
host later, without waiting for the device, as the runtime's label status words are:

* an eager backward copies its count (a device scalar) into a slot of page-locked host
  memory with an asynchronous copy and records an event behind it;
* every later cegen call on that device polls the slots whose event has completed (never
  blocking) and raises :class:`~cegen.CegenError` once for the tokens they counted;
* a backward captured into a CUDA graph adds its count to a counter of its own (made in
  the capture, so each replay starts it at 0); each eager poll copies the counters of the
  graphs captured on the device into slots and zeroes them behind the copy, so a replay
  that met such a token is reported by the next call after it, once;
* :func:`check_fused_gradients` waits for the current stream and reports everything.

:func:`cegen.linear_cross_entropy`'s backward reports a second kind the same way
(:class:`UnpredictedUpstreamError`): an upstream gradient that is not ``grad_weights`` times one
common factor, where the forward's ``d weight`` could not be made right on the device and was
set to NaN (``cegen.linear``).

On the CPU the count is final when the backward returns, so the backward that met the
token raises. The host reads the slots through NumPy views of host memory: no
``Tensor.item()``, ``bool(tensor)`` or device-to-host synchronization anywhere.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._errors import CegenError

__all__ = ["record", "poll", "check_fused_gradients", "ZeroWeightGradientError",
           "UnpredictedUpstreamError", "ZERO_WEIGHT", "LINEAR_UPSTREAM"]


class ZeroWeightGradientError(CegenError):
    """A fused call's token had ``grad_weights`` 0 but a non-zero upstream gradient."""


class UnpredictedUpstreamError(CegenError):
    """A ``linear_cross_entropy`` backward's upstream gradient was not ``grad_weights`` times
    one common factor: its ``d weight`` (and ``d bias``) were set to NaN."""


#: The kinds of report: what :func:`record` counts, and the error :func:`poll` raises.
ZERO_WEIGHT = "zero weight"
LINEAR_UPSTREAM = "linear upstream"

_MESSAGE = (
    "fused cross_entropy: the upstream gradient was non-zero for {count} token(s) whose "
    "grad_weights entry was 0 ({where}), so their gradient was never computed; their "
    "gradient rows were set to NaN. Make grad_weights the gradient the loss will receive "
    "(e.g. the loss mask divided by the token count), or leave grad_weights out"
)

_LINEAR_MESSAGE = (
    "linear_cross_entropy: the upstream gradient of {count} token(s) ({where}) was not "
    "grad_weights times the factor the other tokens' share, so d weight (and d bias), which "
    "the forward finished for grad_weights, cannot be made right without recomputing them; "
    "they were set to NaN (d hidden is right). Pass grad_weights_exact=True (right for any "
    "upstream gradient, two more GEMMs when it is not grad_weights' own tensor), or leave "
    "grad_weights out (four GEMMs); in cegen.megatron's fused output layer, "
    "--no-turbo-ce-fused-gradient"
)

#: kind -> (error class, message, what the report calls the backward)
_KINDS = {
    ZERO_WEIGHT: (ZeroWeightGradientError, _MESSAGE, "fused backward"),
    LINEAR_UPSTREAM: (UnpredictedUpstreamError, _LINEAR_MESSAGE, "linear_cross_entropy backward"),
}


class _Slot:
    """One count on its way to the host: a host word (a view into a block), its NumPy view
    and an event."""

    def __init__(self, word: torch.Tensor, view: Any, cuda: bool):
        self.word = word
        self.view = view
        self.event = torch.cuda.Event() if cuda else None
        self.where = ""
        self.kind = ZERO_WEIGHT


#: Slots made at once: page-locked memory is costly to allocate (about a millisecond of
#: host time on the H200 machine), and while the GPU runs behind the host every eager
#: fused backward holds a slot until its copy has landed.
_BLOCK_SLOTS = 256


def _new_slots(device: torch.device, count: int = _BLOCK_SLOTS) -> List[_Slot]:
    cuda = device.type == "cuda"
    block = torch.zeros((count,), dtype=torch.int64, pin_memory=cuda)
    view = block.numpy()
    return [_Slot(block[i:i + 1], view[i:i + 1], cuda) for i in range(count)]


class _DeviceState:
    def __init__(self, device: torch.device):
        self.device = device
        self.free: List[_Slot] = []
        self.pending: List[_Slot] = []
        self.graph_counters: List[Tuple[torch.Tensor, str, str]] = []
        self.eager_launches = 0

    def take(self) -> _Slot:
        if not self.free:
            self.free = _new_slots(self.device)
        return self.free.pop()


_lock = threading.Lock()
# Keyed by the tensors' torch.device (a CUDA tensor's names its index): hashing one is
# cheap, and poll() runs on every call.
_states: Dict[torch.device, _DeviceState] = {}


def _normalized(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _state(device: torch.device, create: bool) -> Optional[_DeviceState]:
    state = _states.get(device)
    if state is None and create:
        device = _normalized(device)
        with _lock:
            state = _states.setdefault(device, _DeviceState(device))
    return state


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def record(bad: torch.Tensor, kind: str = ZERO_WEIGHT) -> None:
    """Counts the True entries of ``bad`` for a later report of ``kind``; never synchronizes.
    Called by the fused backward (:data:`ZERO_WEIGHT`: tokens with weight 0 and upstream
    gradient != 0) and linear_cross_entropy's (:data:`LINEAR_UPSTREAM`: tokens whose upstream
    gradient is not grad_weights times the common factor)."""
    backward = _KINDS[kind][2]
    device = bad.device
    state = _state(device, create=True)
    assert state is not None
    count = bad.sum(dtype=torch.int64).reshape(1)
    if _capturing(device):
        # Made inside the capture: every replay starts the counter at 0, then adds.
        counter = torch.zeros((1,), dtype=torch.int64, device=device)
        counter.add_(count)
        with _lock:
            state.graph_counters.append(
                (counter, f"a {backward} captured into a CUDA graph on {device}", kind))
        return
    with _lock:
        slot = state.take()
        state.eager_launches += 1
        slot.where = f"{backward} {state.eager_launches} on {device}"
        slot.kind = kind
    slot.word.copy_(count, non_blocking=True)
    if slot.event is not None:
        slot.event.record()
    with _lock:
        state.pending.append(slot)
    if device.type == "cpu":
        poll(device)  # the count is final now: report it from the backward that made it


def _collect_graph_counters(state: _DeviceState) -> None:
    """Queues a copy of each captured counter and zeroes it behind the copy."""
    for counter, where, kind in state.graph_counters:
        slot = state.take()
        slot.where = where
        slot.kind = kind
        slot.word.copy_(counter, non_blocking=True)
        counter.zero_()
        if slot.event is not None:
            slot.event.record()
        state.pending.append(slot)


def poll(device: torch.device) -> None:
    """Raises :class:`ZeroWeightGradientError` (or :class:`UnpredictedUpstreamError`) for
    the counts that have arrived on the host; never blocks. A no-op while the current stream
    is being captured. Counts of both kinds arrived at once: one error, of the first kind,
    whose message says both."""
    if not _states:
        return  # no fused backward has run in this process
    state = _state(device, create=False)
    if state is None or (not state.pending and not state.graph_counters) or _capturing(device):
        return
    arrived: List[_Slot] = []
    with _lock:
        if state.graph_counters:
            _collect_graph_counters(state)
        if not state.pending:
            return
        waiting = []
        for slot in state.pending:
            (arrived if slot.event is None or slot.event.query() else waiting).append(slot)
        state.pending = waiting
        totals: Dict[str, int] = {}
        first: Dict[str, str] = {}
        for slot in arrived:
            value = int(slot.view[0])
            if value:
                first.setdefault(slot.kind, slot.where)
                totals[slot.kind] = totals.get(slot.kind, 0) + value
        state.free.extend(arrived)
    if totals:
        kinds = [kind for kind in _KINDS if kind in totals]
        messages = [_KINDS[kind][1].format(count=totals[kind], where=first[kind])
                    for kind in kinds]
        raise _KINDS[kinds[0]][0]("; and ".join(messages))


def check_fused_gradients(device: Optional[torch.device] = None, wait: bool = True) -> None:
    """Reports fused backwards that met a token with ``grad_weights`` 0 and a non-zero
    upstream gradient, and linear_cross_entropy backwards whose upstream gradient was not
    ``grad_weights`` up to one factor (see ``cegen._gradient_status``).

    Waits for the current stream of ``device`` (default: the current CUDA device, or the
    CPU without CUDA) unless ``wait`` is False, then raises
    :class:`ZeroWeightGradientError` (or :class:`UnpredictedUpstreamError`) once for what
    has not been reported yet.
    """
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.cuda.is_available() else torch.device("cpu"))
    device = _normalized(torch.device(device))
    state = _state(device, create=False)
    if state is None:
        return
    if wait and device.type == "cuda":
        with _lock:
            if state.graph_counters:
                _collect_graph_counters(state)
        torch.cuda.current_stream(device).synchronize()
        with _lock:
            slots = list(state.pending)
        for slot in slots:
            if slot.event is not None:
                slot.event.synchronize()
    poll(device)
