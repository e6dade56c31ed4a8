#!/usr/bin/env python3
"""Host time per call of ``cegen.cross_entropy``, and where it goes.

A program, not a test. It times, in microseconds of host (wall) time per call, the public
API the way a trainer calls it and then each stage of a forward call on its own:

* ``forward`` (no_grad), ``fwd+bwd`` (the call and ``torch.autograd.grad`` with a per-token
  upstream gradient), ``fused`` (``grad_weights=g`` and upstream ``g``, the weights tensor
  itself: no rescale) and ``fused, rescaled`` (upstream ``g * 1``: the device rescale runs);
* stages of a forward: option validation (``kernel_options``, cached per value), input
  checks, the overwrite ownership check, the kernel lookup (variant key, bundle, ce_options;
  cached per call shape), the four descriptors, the ``ce_forward`` call through ctypes, the
  outputs' allocation, the label poll, the custom op's dispatch (PyTorch >= 2.4) and the
  autograd Function around the launch; then what a forward does now instead of the
  checks, lookup and descriptors (``cegen._plans``: the plan's key and lookup, four data
  pointers written, ``ce_forward`` called with the plan's addresses);
* PyTorch's own part: a trivial ``autograd.Function`` that allocates what cegen's does
  (loss and lse; the gradient in backward) and launches nothing, called the same way
  (``floor: ...``): what no change in cegen's Python can remove.

On a GPU every timed loop runs while the stream is busy (a ``torch.cuda._sleep`` queued
first, longer than the loop), so the launches only queue and the wall time is host work
alone; on the CPU the host kernels run inside the call, on a problem (``--tokens``,
``--vocab``) small enough that they cost little. Each figure is the median over
``--repeats`` loops of ``--calls`` calls.

    PYTHONPATH=python /usr/bin/python3 bench/host_overhead.py                 # CPU, here
    python3 bench/host_overhead.py --device cuda --runtime .dev/lib/libce_runtime.so \\
        --bundle .dev/bench/bundles/default                                   # the H200

``bench/api_bench.py`` reports the same figures (:func:`measure`) next to its table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

#: Host time targets of issue 16 (H200): forward, forward + backward.
TARGETS_US = {"forward": 60.0, "fwd+bwd": 250.0}


def _per_call_us(torch: Any, cuda: bool, call: Callable[[], Any], calls: int,
                 repeats: int) -> float:
    """Median over ``repeats`` loops of host microseconds per ``call``."""
    for _ in range(10):
        call()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time: the launches only queue
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return statistics.median(samples)


def _floor_function(torch: Any) -> Any:
    """An autograd.Function that allocates what cegen's does and launches nothing."""

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, labels: Any) -> Any:  # type: ignore[override]
            shape = tuple(labels.shape)
            loss = torch.empty(shape, dtype=torch.float32, device=logits.device)
            lse = torch.empty(shape, dtype=torch.float32, device=logits.device)
            ctx.save_for_backward(logits, labels, lse)
            return loss

        @staticmethod
        def backward(ctx: Any, grad_loss: Any) -> Any:  # type: ignore[override]
            logits, _, _ = ctx.saved_tensors
            return torch.empty_like(logits), None

    return Floor


def measure(torch: Any, cegen: Any, device: Any, *, tokens: int = 64, vocab: int = 4096,
            dtype: Any = None, bundle: Optional[str] = None, calls: int = 100,
            repeats: int = 7, stages: bool = True,
            ignore_index: Optional[int] = None) -> Dict[str, float]:
    """Host microseconds per call: the API paths, then (``stages``) a forward's stages."""
    from cegen import _kernels, _library, _ownership, _plans, ops

    cuda = torch.device(device).type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn((tokens, vocab), generator=gen) * 2).to(dtype).to(device)
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    g = (torch.rand((tokens,), generator=gen) + 0.5).to(device)
    g2 = g * 1.0
    x = logits.detach().clone().requires_grad_(True)

    ce = cegen.cross_entropy
    kw = {"bundle": bundle, "ignore_index": ignore_index}

    def forward() -> None:
        with torch.no_grad():
            ce(logits, labels, **kw)

    def fwd_bwd() -> None:
        torch.autograd.grad(ce(x, labels, **kw), x, g)

    def fused() -> None:
        torch.autograd.grad(ce(x, labels, grad_weights=g, **kw), x, g)

    def fused_rescaled() -> None:
        torch.autograd.grad(ce(x, labels, grad_weights=g, **kw), x, g2)

    result: Dict[str, float] = {}
    for name, call in (("forward", forward), ("fwd+bwd", fwd_bwd), ("fused", fused),
                       ("fused, rescaled", fused_rescaled)):
        try:
            result[name] = round(_per_call_us(torch, cuda, call, calls, repeats), 1)
        except Exception as error:  # noqa: BLE001 - one path failing leaves the others
            print(f"host_overhead: {name} failed: {type(error).__name__}: "
                  f"{str(error).splitlines()[0]}", file=sys.stderr)
            result[name] = float("nan")
    if not stages:
        return result

    # ..., label_out_of_range, logit_scale, logit_softcap
    args = (ignore_index, 0.0, 0.0, "bs", bundle, "error", 1.0, 0.0)
    options = _kernels.kernel_options(*args)
    where = _kernels._device_of(logits, "logits")
    loss, lse = _kernels.forward(logits, labels, options)
    bundle_object, runtime_options = _kernels._launch("forward", logits, labels, options, where)
    runtime = bundle_object.runtime
    descs = [_kernels.describe(t, n) for t, n in ((logits, "logits"), (labels, "labels"),
                                                   (loss, "loss"), (lse, "lse"))]
    stream = _kernels._stream_at(where)
    produced = x * 1.0
    tokens_shape = (tokens,)
    op = getattr(_library.forward, "op", None)

    def apply_function() -> None:
        ops._CrossEntropyFunction.apply(x, labels, *args, False)

    def apply_eager_function() -> None:
        ops._EagerCrossEntropy.apply(x, labels, options, False)

    plans = _plans.thread_plans()

    def plan_lookup() -> Any:  # the key as cegen._kernels.forward makes it
        key = ("forward", options, False, logits.dtype, logits.shape, logits.stride(),
               logits.device, labels.dtype, labels.shape, labels.stride(), labels.device)
        return _kernels._plan_for(plans, key)

    plan = plan_lookup()
    if plan is None or plan.bundle is None:
        raise RuntimeError("no launch plan after a forward: cegen._kernels changed its key")
    plan_descs = plan.descs

    def plan_pointers() -> None:
        plan_descs[0].data = logits.data_ptr()
        plan_descs[1].data = labels.data_ptr()
        plan_descs[2].data = loss.data_ptr()
        plan_descs[3].data = lse.data_ptr()

    def plan_call() -> None:
        plan.entry(plan.bundle.handle, plan.options_address, *plan.addresses, stream)

    floor_apply = ops._c_apply(_floor_function(torch))  # as cegen applies its Functions
    token_shape = tuple(labels.shape)

    def floor_forward() -> None:
        with torch.no_grad():
            torch.empty(token_shape, dtype=torch.float32, device=logits.device)
            torch.empty(token_shape, dtype=torch.float32, device=logits.device)

    def floor_fwd_bwd() -> None:
        torch.autograd.grad(floor_apply(x, labels), x, g)

    steps = {
        "stage: options (kernel_options, cached)": lambda: _kernels.kernel_options(*args),
        "stage: input checks (check_inputs)": lambda: _kernels.check_inputs(logits, labels, options),
        "stage: overwrite ownership check": lambda: _ownership.overwrite_refusal(produced, 2, 0),
        "stage: kernel lookup (_launch, cached)":
            lambda: _kernels._launch("forward", logits, labels, options, where),
        "stage: 4 descriptors (describe)": lambda: [_kernels.describe(t, "t")
                                                    for t in (logits, labels, loss, lse)],
        "stage: ce_forward through ctypes": lambda: runtime.forward(
            bundle_object, runtime_options, *descs, stream),
        "stage: outputs (2 x torch.empty)": lambda: (
            torch.empty(tokens_shape, dtype=torch.float32, device=logits.device),
            torch.empty(tokens_shape, dtype=torch.float32, device=logits.device)),
        "stage: label poll": lambda: _kernels._poll_labels(logits.device, runtime, where, stream),
        "stage: _kernels.forward (all of the above but options)":
            lambda: _kernels.forward(logits, labels, options),
        "stage: the forward custom op, dispatched (PyTorch >= 2.4)":
            (lambda: op(logits, labels, *args)) if op is not None else None,
        "stage: autograd Function apply + forward": apply_function,
        "stage: eager autograd Function apply + forward (the public path)": apply_eager_function,
        "stage: plan key + lookup (a hit)": plan_lookup,
        "stage: 4 data pointers into the plan's descriptors": plan_pointers,
        "stage: ce_forward through ctypes with the plan's addresses": plan_call,
        "floor: forward (2 x torch.empty under no_grad)": floor_forward,
        "floor: fwd+bwd (a trivial autograd.Function, same allocations)": floor_fwd_bwd,
    }
    for name, call in steps.items():
        if call is None:
            result[name] = float("nan")
            continue
        result[name] = round(_per_call_us(torch, cuda, call, calls, repeats), 2)
    return result


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--runtime", default=None, help="libce_runtime.so (default: the build's)")
    parser.add_argument("--bundle", default=None, help="a bundle directory holding the kernels")
    parser.add_argument("--tokens", type=int, default=None, help="N (default 64 on a GPU, 8 on the CPU)")
    parser.add_argument("--vocab", type=int, default=None, help="V (default 4096, 64 on the CPU)")
    parser.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                        help="logits dtype (default bf16 on a GPU, f32 on the CPU)")
    parser.add_argument("--ignore-index", type=int, default=None)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    import torch

    import cegen

    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    if not cuda:
        torch.set_num_threads(1)
    tokens = args.tokens or (64 if cuda else 8)
    vocab = args.vocab or (4096 if cuda else 64)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}.get(args.dtype or "")
    result = measure(torch, cegen, args.device, tokens=tokens, vocab=vocab, bundle=args.bundle,
                     calls=args.calls, repeats=args.repeats, dtype=dtype,
                     ignore_index=args.ignore_index)
    print(f"cegen host time per call, {tokens}x{vocab} on {args.device}, torch {torch.__version__}, "
          f"custom ops {cegen.HAS_CUSTOM_OP}; median of {args.repeats} loops of {args.calls} calls")
    for name, value in result.items():
        target = TARGETS_US.get(name)
        note = f"   (target <= {target:.0f} us on the H200)" if target else ""
        print(f"  {name:66s} {value:9.2f} us{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
