"""Launch plans: what a launch of one call shape needs besides its tensors' data pointers.

A trainer calls the loss with the same shapes, strides, dtypes and options every step.
``cegen._kernels`` keys a :class:`Plan` by those (the tensors' metadata and the options,
see its ``_*_key`` functions) and builds it on the first call: the inputs checked, the
kernel looked up, the ``ce_options`` struct, and one runtime descriptor per tensor with
its sizes, strides, dtype and device filled in. A later call with the same key only
writes the data pointers into those descriptors and calls the C entry point with their
addresses: the host time of a launch (issue 16).

A plan's descriptors are written on every call, and the runtime reads them while the
GIL is released, so each thread has plans of its own (:func:`thread_plans`). A key
covers everything the checks and the descriptors read, so a hit is a call that passed
the same checks; a miss checks again. Plans made before
``cegen._bundle_cache.clear_open_bundles`` (its ``generation``) are made again.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from ._runtime import Device, TensorDesc

__all__ = ["Plan", "entry_point", "thread_plans", "store"]

#: Plans a thread keeps; all are dropped when one more is made (a trainer uses a few).
PLANS_PER_THREAD = 256


class Plan:
    """One call shape's launch: the token shape, the device, and (when there are tokens)
    the bundle, C entry point, ``ce_options`` address and descriptors.

    ``descs`` holds a descriptor per tensor argument in the entry point's order, None
    for an absent one (a gradient written over the logits); ``addresses`` their
    addresses, passed as the entry point's ``void *`` arguments. ``low_desc``,
    ``entropy_desc``, ``argmax_desc``: the descriptors of lse's low part and of the
    entropy and argmax outputs, which ``ce_options.lse_low`` / ``.entropy`` /
    ``.argmax`` of the plan's own copy of the options point at (None: not passed)."""

    __slots__ = ("generation", "tokens", "device", "where", "gpu", "bundle", "runtime",
                 "entry", "check_labels", "runtime_options", "options_address", "descs",
                 "addresses", "low_desc", "entropy_desc", "argmax_desc")

    def __init__(self, generation: int, tokens: Tuple[int, ...], device: Any,
                 where: Tuple[int, int]):
        self.generation = generation
        self.tokens = tokens
        self.device = device
        self.where = where
        self.gpu = where[0] != Device.HOST
        self.bundle: Any = None  # None: no tokens, nothing to launch
        self.runtime: Any = None
        self.entry: Any = None
        self.check_labels: Any = None
        self.runtime_options: Any = None
        self.options_address = 0
        self.descs: Tuple[Optional[TensorDesc], ...] = ()
        self.addresses: Tuple[Optional[int], ...] = ()
        self.low_desc: Optional[TensorDesc] = None
        self.entropy_desc: Optional[TensorDesc] = None
        self.argmax_desc: Optional[TensorDesc] = None

    def set_launch(self, bundle: Any, runtime_options: Any, entry: str,
                   descs: Sequence[Optional[TensorDesc]],
                   low_desc: Optional[TensorDesc] = None,
                   entropy_desc: Optional[TensorDesc] = None,
                   argmax_desc: Optional[TensorDesc] = None) -> None:
        """Fills in the launch: ``descs`` made by ``cegen._kernels.describe`` from this
        call's tensors (their data pointers are rewritten on every call), and
        ``low_desc`` for lse's low part (``ce_options.lse_low``), ``entropy_desc`` and
        ``argmax_desc`` for the outputs (``ce_options.entropy`` / ``.argmax``), if any."""
        self.bundle = bundle
        self.runtime = bundle.runtime
        self.entry = entry_point(bundle.runtime, entry)
        self.check_labels = bundle.runtime._lib.ce_check_label_status  # declared: ints
        optional = (("lse_low", low_desc), ("entropy", entropy_desc),
                    ("argmax", argmax_desc))
        if any(desc is not None for _, desc in optional):
            # The shared options struct of this call's variant is not changed: this
            # plan's copy points at its own descriptors.
            own = type(runtime_options)()
            ctypes.memmove(ctypes.addressof(own), ctypes.addressof(runtime_options),
                           ctypes.sizeof(own))
            for field, desc in optional:
                if desc is not None:
                    setattr(own, field, ctypes.addressof(desc))
            runtime_options = own
        self.low_desc = low_desc
        self.entropy_desc = entropy_desc
        self.argmax_desc = argmax_desc
        self.runtime_options = runtime_options  # kept alive: the C call reads its address
        self.options_address = ctypes.addressof(runtime_options)
        self.descs = tuple(descs)
        self.addresses = tuple(None if desc is None else ctypes.addressof(desc)
                               for desc in self.descs)


def entry_point(runtime: Any, name: str) -> Any:
    """The runtime's C function ``name`` (a launch: ``ce_forward``, ``ce_backward``,
    ``ce_fused``) declared with every argument a ``void *``: ctypes converts an int or
    None faster than it checks a ``byref`` against a pointer type. One per name."""
    functions = runtime.__dict__.setdefault("_plan_entry_points", {})
    function = functions.get(name)
    if function is None:
        declared = getattr(runtime._lib, name)  # its declared signature gives the count
        function = runtime._lib[name]  # a second function object, with its own argtypes
        function.argtypes = [ctypes.c_void_p] * len(declared.argtypes)
        function.restype = ctypes.c_int
        functions[name] = function
    return function


_local = threading.local()


def thread_plans() -> Dict[Tuple[Any, ...], Plan]:
    """This thread's plans by key."""
    try:
        return _local.plans
    except AttributeError:
        plans: Dict[Tuple[Any, ...], Plan] = {}
        _local.plans = plans
        return plans


def store(plans: Dict[Tuple[Any, ...], Plan], key: Optional[Tuple[Any, ...]], plan: Plan) -> None:
    """Keeps ``plan`` under ``key`` (None: an unkeyable call, not kept)."""
    if key is None:
        return
    if len(plans) >= PLANS_PER_THREAD:
        plans.clear()
    plans[key] = plan
