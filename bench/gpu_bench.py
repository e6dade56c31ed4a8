#!/usr/bin/env python3
"""GPU benchmark: cegen's generated kernels against PyTorch eager and torch.compile.

A program, not a test. On a CUDA machine, from the repository root, with a runtime library
and sm_90 bundles made on a machine that has ce-gen (see docs/PERFORMANCE.md)::

    python3 bench/gpu_bench.py --runtime .dev/bench/lib/libce_runtime.so \\
        --bundle .dev/bench/bundles/default \\
        --sweep .dev/bench/bundles/b*_u* --out $OUT

What it measures, in one process, on bf16 logits ~ randn and int64 labels ~ U[0, V):

* our kernels, called through the runtime's C API via the package's ctypes binding
  (``cegen._runtime.Runtime.forward/backward/fused`` on a bundle opened once; the
  step allocates its outputs with torch and describes the tensors, as the package does):
  ``fwd`` (loss, lse); ``bwd`` / ``bwd_ow`` (gradient from lse and an arbitrary per-token
  upstream gradient, into a new buffer / over the logits); ``fwd+bwd`` / ``fwd+bwd_ow``
  (both kernels back to back); ``fused`` / ``fused_ow`` (one kernel: loss, lse and the
  gradient for per-token weights, into a new buffer / over the logits);
* ``torch eager``: ``F.cross_entropy(logits.float(), labels, reduction='none')``, forward
  under no_grad, backward by ``torch.autograd.grad`` with the same per-token gradient;
* ``torch.compile`` of that function (``dynamic=False``, default mode, compiled per shape,
  compile time excluded);
* the device-to-device copy bandwidth (4 GB ``dst.copy_(src)``, bytes read + written) and
  the read bandwidth (``torch.sum`` over 4 GB of bf16), which set the floors of DESIGN.md
  section 2: fwd reads N*V*2 bytes, bwd and fused move 2*N*V*2, fwd+bwd 3*N*V*2; floor time
  = bytes / copy bandwidth;
* the host cost of one call (C API through ctypes, and ``cegen.cross_entropy``), on a
  problem small enough that the GPU keeps up.

Timing follows shared/anchors/peers-h200.md: per timed call an untimed restore of the
logits when the variant overwrites them, a 256 MB write that flushes the L2, a short GPU
sleep (so the host's launch cost is not timed), then CUDA events around the call; the
median over many calls after warm-up. ``extra GB`` is ``torch.cuda.max_memory_allocated``
during one call minus what was allocated before it (inputs excluded, outputs included).

``--sweep DIR...`` first times fwd, bwd_ow and fused_ow of each bundle (one tuning
config each, e.g. ``ce-gen --block-size=512 --unroll=4``) at ``--sweep-shapes``, picks the
fastest config per kernel, and adds it to the full table as config ``best``.

``--peers DIR`` adds the peers of issue #7, imported unmodified from upstream sources under DIR
(never committed; ``.dev/peers/SOURCES.md``): flash-attention's Triton ``cross_entropy_loss``
(reduction none; ``inplace_backward`` False and True) and Liger-Kernel's
``LigerCrossEntropyFunction`` (reduction none and mean), timed as the torch baselines on the same
inputs (bench/peers.py says how each is called), with their losses and gradients checked
(reported, not failures) and a column ``vs flash_ce`` on our rows: flash_ce's time / ours (fwd;
fwd+bwd for the fwd+bwd and fused rows). A peer that cannot be imported is reported, not run.

``--device cpu`` runs the same program on host bundles (``ce-gen --target=host``) with a
wall clock: a check of the harness where no GPU is reachable, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent

DEFAULT_SHAPES = "8192x128256,16384x32000,4096x151936,8192x50304,32768x128256"
DEFAULT_SWEEP_SHAPES = "8192x128256,16384x32000"

# Our variants: name -> (floor passes over N*V*2 bytes, the torch baseline it is compared with)
OUR_VARIANTS = {
    "fwd": (1, "fwd"),
    "bwd": (2, "bwd"),
    "bwd_ow": (2, "bwd"),
    "fwd+bwd": (3, "fwd+bwd"),
    "fwd+bwd_ow": (3, "fwd+bwd"),
    "fused": (2, "fwd+bwd"),
    "fused_ow": (2, "fwd+bwd"),
}
TORCH_VARIANTS = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}
SWEEP_KERNELS = ("fwd", "bwd_ow", "fused_ow")
# Which sweep result picks the config of each kernel role of the "best" set.
ROLE_OF_SWEEP = {"fwd": ("forward",), "bwd_ow": ("backward0", "backward1"),
                 "fused_ow": ("fused0", "fused1")}
TARGETS = {"fwd": 88.0, "fwd+bwd_ow": 88.0, "fwd+bwd": 88.0, "fused_ow": 85.0}

FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 2_000_000  # ~1 ms at 1.98 GHz: longer than any step's host-side launch cost
COPY_BYTES = 4 << 30

_t0 = time.perf_counter()


def log(message: str = "") -> None:
    print(message, flush=True)


def elapsed_s() -> float:
    return time.perf_counter() - _t0


def parse_shapes(text: str) -> List[Tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        n, v = item.lower().split("x")
        shapes.append((int(n), int(v)))
    return shapes


def shape_name(shape: Tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


# -- the device: CUDA events or a wall clock ---------------------------------------------------


class Dev:
    def __init__(self, torch: Any, kind: str):
        self.torch = torch
        self.cuda = kind == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.flush_buf = (torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=self.device)
                          if self.cuda else None)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def flush(self) -> None:
        if self.cuda:
            self.flush_buf.zero_()

    def sleep(self) -> None:
        if self.cuda:
            self.torch.cuda._sleep(SLEEP_CYCLES)

    def mark(self) -> Any:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, begin: Any, end: Any) -> float:
        if self.cuda:
            return begin.elapsed_time(end)
        return (end - begin) * 1e3

    def stream(self) -> Optional[int]:
        return self.torch.cuda.current_stream().cuda_stream if self.cuda else None

    def peak_extra(self, step: Callable[[], Any], setup: Optional[Callable[[], Any]]) -> Optional[int]:
        """Bytes allocated at the peak of one ``step`` beyond what was allocated before it."""
        if not self.cuda:
            return None
        torch = self.torch
        if setup is not None:
            setup()
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        self.sync()
        return torch.cuda.max_memory_allocated() - base


def time_step(dev: Dev, step: Callable[[], Any], setup: Optional[Callable[[], Any]], reps: Optional[int],
              warmup: int = 2, target_ms: float = 300.0, min_reps: int = 10,
              max_reps: int = 40) -> Dict[str, Any]:
    """Median time of ``step``; before each timed call: ``setup`` (untimed), an L2 flush and a
    GPU sleep. ``reps`` None: as many as fit in ``target_ms`` of work, within [min, max]."""
    estimate = None
    for _ in range(max(1, warmup)):
        if setup is not None:
            setup()
        dev.flush()
        dev.sleep()
        begin = dev.mark()
        step()
        end = dev.mark()
        dev.sync()
        estimate = dev.ms(begin, end)
    if reps is None:
        reps = int(min(max_reps, max(min_reps, round(target_ms / max(estimate, 1e-3)))))
    marks = []
    for _ in range(reps):
        if setup is not None:
            setup()
        dev.flush()
        dev.sleep()
        begin = dev.mark()
        step()
        end = dev.mark()
        marks.append((begin, end))
    dev.sync()
    times = sorted(dev.ms(b, e) for b, e in marks)
    median = statistics.median(times)
    p10 = times[int(0.1 * (len(times) - 1))]
    p90 = times[int(math.ceil(0.9 * (len(times) - 1)))]
    return {"ms": median, "min_ms": times[0], "p10_ms": p10, "p90_ms": p90, "reps": reps}


# -- our kernels through the C API -------------------------------------------------------------


class KernelSet:
    """Which bundle each kernel role comes from: one config, or a mix ("best")."""

    ROLES = ("forward", "backward0", "backward1", "fused0", "fused1")

    def __init__(self, name: str, sources: Dict[str, Tuple[Any, str]], keys: Dict[str, str]):
        self.name = name
        self.sources = sources  # role -> (Bundle, config name)
        self.keys = keys        # role -> variant key string

    def describe(self) -> str:
        names = {role: src[1] for role, src in self.sources.items()}
        if len(set(names.values())) == 1:
            return next(iter(names.values()))
        return (f"fwd {names['forward']}, bwd {names['backward1']}, fused {names['fused1']}")


def variant_keys(cegen: Any) -> Dict[str, str]:
    """The kernels of each role: bf16, int64 labels, [N, V], no smoothing or z-loss (bundle
    format version 3: the ignore_index is a run-time argument, not part of a key)."""
    from cegen import VariantKey

    def key(op: str, overwrite: bool = False, weights: str = "none") -> str:
        return str(VariantKey(op=op, logits="bf16", labels="i64", layout="flat",
                              overwrite=overwrite, weights=weights))

    return {"forward": key("forward"), "backward0": key("backward"),
            "backward1": key("backward", overwrite=True),
            "fused0": key("fused", weights="token"),
            "fused1": key("fused", overwrite=True, weights="token")}


def open_config(rt: Any, directory: str, keys: Dict[str, str], target: str) -> KernelSet:
    bundle = rt.open_bundle(Path(directory).resolve())
    name = Path(directory).resolve().name
    missing = [keys[role] for role in KernelSet.ROLES if not bundle.has(keys[role], target)]
    if missing:
        raise RuntimeError(f"bundle {directory} lacks {target} kernels: {missing}")
    return KernelSet(name, {role: (bundle, name) for role in KernelSet.ROLES}, keys)


class Problem:
    """One shape's inputs: logits (and a pristine copy to restore), labels, per-token grads."""

    def __init__(self, torch: Any, dev: Dev, n: int, v: int, seed: int):
        gen = torch.Generator(device=dev.device).manual_seed(seed)
        self.n, self.v = n, v
        self.logits = torch.randn((n, v), generator=gen, device=dev.device, dtype=torch.float32
                                  ).to(torch.bfloat16) if not dev.cuda else \
            torch.randn((n, v), generator=gen, device=dev.device, dtype=torch.bfloat16)
        self.pristine = self.logits.clone()
        self.labels = torch.randint(0, v, (n,), generator=gen, device=dev.device, dtype=torch.int64)
        # Arbitrary per-token upstream gradient (also the fused kernel's weights).
        self.grad_loss = torch.empty((n,), device=dev.device, dtype=torch.float32).uniform_(
            0.5, 1.5, generator=gen)
        self.bytes = n * v * 2

    def restore(self) -> None:
        self.logits.copy_(self.pristine)


class Ours:
    """Calls the runtime directly: ``Runtime.forward/backward/fused`` (ctypes -> C API)."""

    def __init__(self, cegen: Any, rt: Any, kset: KernelSet, prob: Problem, dev: Dev,
                 ignore_index: Optional[int]):
        from cegen import _runtime

        self.torch = dev.torch
        self.rt, self.kset, self.p, self.dev = rt, kset, prob, dev
        self._runtime = _runtime
        self.device_type = _runtime.Device.CUDA if dev.cuda else _runtime.Device.HOST
        self.index = (dev.device.index or 0) if dev.cuda else 0
        self.codes = {self.torch.bfloat16: _runtime.DType.BF16, self.torch.float32: _runtime.DType.F32,
                      self.torch.int64: _runtime.DType.I64}
        self.opts = {}
        for overwrite in (False, True):
            options = rt.default_options()
            if ignore_index is not None:
                options.has_ignore_index = 1
                options.ignore_index = ignore_index
            options.overwrite_input = 1 if overwrite else 0
            options.label_layout = _runtime.LabelLayout.BS
            self.opts[overwrite] = options

    def d(self, tensor: Any) -> Any:
        return self._runtime.TensorDesc.make(tensor.data_ptr(), self.codes[tensor.dtype],
                                             list(tensor.shape), list(tensor.stride()),
                                             self.device_type, self.index)

    def bundle(self, role: str) -> Any:
        return self.kset.sources[role][0]

    def forward(self) -> Tuple[Any, Any]:
        p, torch = self.p, self.torch
        loss = torch.empty((p.n,), dtype=torch.float32, device=p.logits.device)
        lse = torch.empty((p.n,), dtype=torch.float32, device=p.logits.device)
        self.rt.forward(self.bundle("forward"), self.opts[False], self.d(p.logits), self.d(p.labels),
                        self.d(loss), self.d(lse), self.dev.stream())
        return loss, lse

    def backward(self, lse: Any, overwrite: bool) -> Any:
        p = self.p
        grad = None if overwrite else self.torch.empty_like(p.logits)
        self.rt.backward(self.bundle("backward1" if overwrite else "backward0"), self.opts[overwrite],
                         self.d(p.logits), self.d(p.labels), self.d(lse), self.d(p.grad_loss),
                         None if grad is None else self.d(grad), self.dev.stream())
        return p.logits if overwrite else grad

    def fused(self, overwrite: bool) -> Tuple[Any, Any, Any]:
        p, torch = self.p, self.torch
        loss = torch.empty((p.n,), dtype=torch.float32, device=p.logits.device)
        lse = torch.empty((p.n,), dtype=torch.float32, device=p.logits.device)
        grad = None if overwrite else torch.empty_like(p.logits)
        self.rt.fused(self.bundle("fused1" if overwrite else "fused0"), self.opts[overwrite],
                      self.d(p.logits), self.d(p.labels), self.d(p.grad_loss), self.d(loss),
                      self.d(lse), None if grad is None else self.d(grad), self.dev.stream())
        return loss, lse, (p.logits if overwrite else grad)

    def check_labels(self) -> None:
        self.rt.check_label_status(self.device_type, self.index, self.dev.stream(), True)

    # (step, setup) per variant
    def steps(self) -> Dict[str, Tuple[Callable[[], Any], Optional[Callable[[], Any]]]]:
        state: Dict[str, Any] = {}

        def need_lse() -> None:
            if "lse" not in state:
                self.p.restore()
                state["lse"] = self.forward()[1]

        def bwd_setup() -> None:
            need_lse()

        def bwd_ow_setup() -> None:
            need_lse()
            self.p.restore()

        def fwd_bwd(overwrite: bool) -> None:
            _, lse = self.forward()
            self.backward(lse, overwrite)

        def fwd() -> None:
            self.forward()

        def bwd(overwrite: bool) -> None:
            self.backward(state["lse"], overwrite)

        def fused(overwrite: bool) -> None:
            self.fused(overwrite)

        return {
            "fwd": (fwd, None),
            "bwd": (lambda: bwd(False), bwd_setup),
            "bwd_ow": (lambda: bwd(True), bwd_ow_setup),
            "fwd+bwd": (lambda: fwd_bwd(False), None),
            "fwd+bwd_ow": (lambda: fwd_bwd(True), self.p.restore),
            "fused": (lambda: fused(False), None),
            "fused_ow": (lambda: fused(True), self.p.restore),
        }


# -- sanity checks (untimed; the numerics are tested by test/gpu/test_h200.py) -------------------


class Checker:
    def __init__(self, torch: Any, F: Any, prob: Problem, seed: int):
        self.torch = torch
        p = prob
        self.p = p
        with torch.no_grad():
            chunks = []
            for start in range(0, p.n, 4096):
                stop = min(p.n, start + 4096)
                chunks.append(F.cross_entropy(p.pristine[start:stop].float(), p.labels[start:stop],
                                              reduction="none"))
            self.ref_loss = torch.cat(chunks)
        gen = torch.Generator().manual_seed(seed)
        rows = {0, 1, p.n // 2, p.n - 1} | set(torch.randint(0, p.n, (4,), generator=gen).tolist())
        self.rows = torch.tensor(sorted(rows), device=p.logits.device)
        x = p.pristine[self.rows].double()
        prob_rows = torch.softmax(x, dim=1)
        onehot = torch.zeros_like(prob_rows)
        onehot[torch.arange(len(self.rows), device=x.device), p.labels[self.rows]] = 1.0
        self.ref_grad = p.grad_loss[self.rows].double()[:, None] * (prob_rows - onehot)

    def loss(self, what: str, loss: Any) -> float:
        return float(((loss.double() - self.ref_loss.double()).abs()
                      / self.ref_loss.double().abs().clamp(min=1.0)).max())

    def grad(self, what: str, grad: Any) -> float:
        ours = grad[self.rows].double()
        ref = self.ref_grad
        scale = ref.abs().amax(dim=1, keepdim=True)
        return float(((ours - ref).abs() / (ref.abs() + 1e-6 * scale)).max())


def check_config(ours: Ours, checker: Checker, label: str) -> Dict[str, float]:
    """Runs each kernel once and compares with the reference; leaves the logits pristine."""
    p = ours.p
    out: Dict[str, float] = {}
    p.restore()
    loss, lse = ours.forward()
    out["fwd_loss"] = checker.loss(f"{label} fwd", loss)
    out["bwd_grad"] = checker.grad(f"{label} bwd", ours.backward(lse, False))
    out["bwd_ow_grad"] = checker.grad(f"{label} bwd_ow", ours.backward(lse, True))
    p.restore()
    loss, _, grad = ours.fused(False)
    out["fused_loss"] = checker.loss(f"{label} fused", loss)
    out["fused_grad"] = checker.grad(f"{label} fused", grad)
    del grad
    loss, _, grad = ours.fused(True)
    out["fused_ow_loss"] = checker.loss(f"{label} fused_ow", loss)
    out["fused_ow_grad"] = checker.grad(f"{label} fused_ow", grad)
    p.restore()
    ours.check_labels()
    ours.dev.sync()
    return out


# -- torch baselines ---------------------------------------------------------------------------


def torch_steps(torch: Any, fn: Callable[[Any, Any], Any], prob: Problem
                ) -> Dict[str, Tuple[Callable[[], Any], Optional[Callable[[], Any]]]]:
    x = prob.logits.detach().requires_grad_(True)
    g = prob.grad_loss
    held: Dict[str, Any] = {}

    def fwd() -> None:
        with torch.no_grad():
            fn(prob.logits, prob.labels)

    def fwd_bwd() -> None:
        loss = fn(x, prob.labels)
        torch.autograd.grad(loss, x, g)

    def bwd_setup() -> None:
        held["loss"] = fn(x, prob.labels)

    def bwd() -> None:
        torch.autograd.grad(held.pop("loss"), x, g)

    return {"fwd": (fwd, None), "fwd+bwd": (fwd_bwd, None), "bwd": (bwd, bwd_setup)}


# -- bandwidth ceilings ------------------------------------------------------------------------


def ceilings(torch: Any, dev: Dev, nbytes: int) -> Dict[str, Any]:
    buffers = [torch.empty(nbytes // 4, dtype=torch.float32, device=dev.device).uniform_()]
    buffers.append(torch.empty_like(buffers[0]))
    copy = time_step(dev, lambda: buffers[1].copy_(buffers[0]), None, reps=10)
    buffers[1] = buffers[0].view(torch.bfloat16)
    read = time_step(dev, lambda: buffers[1].sum(), None, reps=10)
    buffers.clear()
    return {"bytes": nbytes, "copy_ms": copy["ms"], "copy_Bps": 2 * nbytes / (copy["ms"] * 1e-3),
            "read_ms": read["ms"], "read_Bps": nbytes / (read["ms"] * 1e-3)}


# -- host cost of one call ---------------------------------------------------------------------


def host_overhead(torch: Any, F: Any, cegen: Any, rt: Any, kset: KernelSet, dev: Dev,
                  ignore_index: Optional[int], seed: int) -> Dict[str, float]:
    """Microseconds of host time per call on [64, 4096], where the GPU keeps up."""
    prob = Problem(torch, dev, 64, 4096, seed)
    ours = Ours(cegen, rt, kset, prob, dev, ignore_index)
    bundle_fwd = kset.sources["forward"][0]
    loss = torch.empty((64,), device=dev.device)
    lse = torch.empty((64,), device=dev.device)
    descs = (ours.d(prob.logits), ours.d(prob.labels), ours.d(loss), ours.d(lse))
    stream = dev.stream()
    x = prob.logits.detach().clone().requires_grad_(True)
    g = prob.grad_loss

    def c_api() -> None:
        rt.forward(bundle_fwd, ours.opts[False], *descs, stream)

    def package_fwd() -> None:
        with torch.no_grad():
            cegen.cross_entropy(prob.logits, prob.labels, ignore_index=ignore_index, bundle=bundle_fwd)

    def package_fwd_bwd() -> None:
        out = cegen.cross_entropy(x, prob.labels, ignore_index=ignore_index,
                                  bundle=kset.sources["backward0"][0])
        torch.autograd.grad(out, x, g)

    def package_fused() -> None:
        out = cegen.cross_entropy(x, prob.labels, ignore_index=ignore_index, grad_weights=g,
                                  bundle=kset.sources["fused0"][0])
        torch.autograd.grad(out, x, g)

    def eager_fwd() -> None:
        with torch.no_grad():
            F.cross_entropy(prob.logits.float(), prob.labels, reduction="none")

    calls = {
        "C API forward (ctypes, descriptors made once)": c_api,
        "bench step: forward (outputs allocated, descriptors made, C API)": lambda: ours.forward(),
        "bench step: fwd+bwd": lambda: ours.backward(ours.forward()[1], False),
        "cegen.cross_entropy forward (no_grad, bundle=)": package_fwd,
        "cegen.cross_entropy + autograd.grad (fwd+bwd)": package_fwd_bwd,
        "cegen.cross_entropy(grad_weights=) + autograd.grad (fused)": package_fused,
        "torch eager F.cross_entropy forward (reference)": eager_fwd,
    }
    result = {}
    for name, call in calls.items():
        # the kernels are separate bundles only if the sets differ: bundle= names one bundle
        # per call, so the fused / backward sources are used for those calls
        try:
            for _ in range(20):
                call()
            dev.sync()
            count = 300
            start = time.perf_counter()
            for _ in range(count):
                call()
            per_call = (time.perf_counter() - start) / count * 1e6
            dev.sync()
            result[name] = round(per_call, 1)
        except Exception as error:  # a host-cost probe must not stop the benchmark
            result[name] = float("nan")
            log(f"  host overhead {name}: FAILED {type(error).__name__}: {error}")
    ours.check_labels()
    return result


# -- output ------------------------------------------------------------------------------------


def fmt_ratio(value: Optional[float]) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def fmt_gb(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def row_line(r: Dict[str, Any], flash: bool = False) -> str:
    """``flash``: with the ``vs flash_ce`` column (runs with --peers)."""
    return (f"| {r['shape']} | {r['impl']} | {r['variant']} | {r['config']} | {r['ms']:.3f} | "
            f"{r['TBps']:.2f} | {r['pct_floor']:.0f} | {fmt_gb(r.get('extra_bytes'))} | "
            f"{fmt_ratio(r.get('vs_eager'))} | {fmt_ratio(r.get('vs_compile'))} |"
            + (f" {fmt_ratio(r.get('vs_flash_ce'))} |" if flash else ""))


TABLE_HEAD = ("| shape N×V | impl | variant | config | ms | TB/s | % of floor | extra GB | vs eager | "
              "vs compile |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|")
TABLE_HEAD_FLASH = ("| shape N×V | impl | variant | config | ms | TB/s | % of floor | extra GB | vs eager | "
                    "vs compile | vs flash_ce |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")


def table_head(flash: bool) -> str:
    return TABLE_HEAD_FLASH if flash else TABLE_HEAD


def sweep_markdown(sweep: Dict[str, Any], shapes: Sequence[str]) -> str:
    head = "| config | " + " | ".join(f"{s} {k}" for s in shapes for k in SWEEP_KERNELS) + " |"
    sep = "|---|" + "---:|" * (len(shapes) * len(SWEEP_KERNELS))
    lines = [head, sep]
    configs = sweep["configs"]
    best = sweep.get("best", {})
    for config in configs:
        cells = []
        for s in shapes:
            for k in SWEEP_KERNELS:
                entry = sweep["results"].get(s, {}).get(config, {}).get(k)
                if entry is None:
                    cells.append("-")
                    continue
                mark = "**" if best.get(k) == config else ""
                cells.append(f"{mark}{entry['ms']:.3f} ({entry['pct_floor']:.0f}%){mark}")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_outputs(out: Optional[Path], results: Dict[str, Any]) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    md = [f"# gpu_bench {results['meta'].get('date', '')}", "",
          "```", json.dumps(results["meta"], indent=1, default=str), "```", ""]
    if results.get("ceilings"):
        c = results["ceilings"]
        md.append(f"copy {c['copy_Bps'] / 1e12:.2f} TB/s ({c['copy_ms']:.3f} ms for {c['bytes'] / 1e9:.1f} GB "
                  f"read + written); read {c['read_Bps'] / 1e12:.2f} TB/s")
        md.append("")
    if results.get("sweep", {}).get("results"):
        md += ["## Sweep (ms, % of floor; bold: the config chosen per kernel, least sum over shapes "
               "of time / best time)", "",
               sweep_markdown(results["sweep"], list(results["sweep"]["results"])), ""]
    flash = "peers" in results
    if results.get("peers"):
        md += ["## Peers (--peers " + str(results["meta"].get("peers_dir")) + ")", "",
               "| peer | status | module file | git blob | note |", "|---|---|---|---|---|"]
        for peer, entry in results["peers"].items():
            md.append(f"| {peer} | {'imported' if entry.get('ok') else 'UNAVAILABLE: ' + entry.get('why', '')} | "
                      f"{entry.get('file', '-')} | {entry.get('blob', '-')} | {entry.get('note', '')} |")
        md.append("")
        if results.get("peer_checks"):
            md += ["Peer checks (reported, not failures): loss max abs diff from the fp32 torch loss "
                   "(reduction mean: of the mean), gradient max relative error on the sampled rows "
                   "against float64", ""]
            md += [f"- {name}: {entry}" for name, entry in results["peer_checks"].items()]
            md.append("")
    if results.get("rows"):
        md += ["## Full table", "", table_head(flash)] + [row_line(r, flash) for r in results["rows"]] + [""]
    if results.get("host_overhead"):
        md += ["## Host cost per call (us)", ""] + [f"- {k}: {v}" for k, v in results["host_overhead"].items()]
    (out / "gpu_bench.md").write_text("\n".join(md) + "\n")


def device_meta(torch: Any, dev: Dev) -> Dict[str, Any]:
    meta: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                            "torch": torch.__version__, "python": platform.python_version()}
    if dev.cuda:
        props = torch.cuda.get_device_properties(dev.device)
        meta.update({"device": props.name, "sms": props.multi_processor_count,
                     "l2_MB": getattr(props, "L2_cache_size", 0) / 1e6,
                     "memory_GiB": round(props.total_memory / 2**30, 1),
                     "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability())})
        meta["nvidia_smi"] = nvidia_smi()
    return meta


def nvidia_smi() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
             "power.draw,temperature.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as error:  # reading clocks is optional
        return f"nvidia-smi failed: {error}"


# -- main --------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", action="append", default=[], metavar="DIR",
                        help="a bundle (one tuning config) for the full table; repeatable; "
                             "the first is the default config")
    parser.add_argument("--runtime", default=None, help="libce_runtime.so (default: the package's lookup)")
    parser.add_argument("--package", default=str(REPO / "python"),
                        help="directory holding the cegen package (default: python/ of this checkout)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"NxV,... (default {DEFAULT_SHAPES})")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed calls per variant (default: ~300 ms of work, 10 to 40)")
    parser.add_argument("--out", default=None, help="directory for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--sweep", nargs="*", default=[], metavar="DIR",
                        help="bundles (tuning configs) to sweep first; adds config 'best'")
    parser.add_argument("--sweep-shapes", default=DEFAULT_SWEEP_SHAPES)
    parser.add_argument("--sweep-reps", type=int, default=15)
    parser.add_argument("--ignore-index", default="-100",
                        help="the calls' ignore_index, a run-time argument ('none' or an int; "
                             "default -100, as F.cross_entropy); labels never take it")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--no-host-overhead", action="store_true")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="stop starting new shapes after this many seconds (default 480)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: host bundles and a wall clock, to check the harness")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--peers", default=None, metavar="DIR",
                        help="also time flash-attention's and Liger-Kernel's Triton cross entropy, "
                             "imported from upstream sources under DIR (e.g. .dev/peers); "
                             "default: none")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(args.package).resolve()))
    import torch
    import torch.nn.functional as F

    import cegen
    from cegen import _runtime

    if not args.bundle:
        parser.error("give at least one --bundle DIR")
    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark (use --device cpu to check the harness)")
        return 1
    if args.runtime:
        cegen.set_runtime_library(args.runtime)
    rt = _runtime.get_runtime()
    ignore_index = None if args.ignore_index == "none" else int(args.ignore_index)
    dev = Dev(torch, args.device)
    target = "host"
    if dev.cuda:
        major, minor = torch.cuda.get_device_capability()
        target = f"sm_{major}{minor}"
    keys = variant_keys(cegen)
    out = Path(args.out) if args.out else None

    results: Dict[str, Any] = {"meta": device_meta(torch, dev), "rows": [], "checks": {},
                               "failures": [], "sweep": {}, "host_overhead": {}}
    results["meta"].update({"argv": sys.argv, "runtime": str(rt.path), "target": target,
                            "ignore_index": ignore_index, "cegen_package": cegen.__file__,
                            "sleep_cycles": SLEEP_CYCLES, "flush_bytes": FLUSH_BYTES})
    log(f"gpu_bench: {json.dumps(results['meta'], default=str)}")

    # -- peers (issue #7): imported here so that their status is in the output from the start
    peers: Any = None
    peer_modules: Dict[str, Any] = {}
    if args.peers is not None:
        peers = import_peers()
        results["meta"]["peers_dir"] = args.peers
        started = time.perf_counter()
        peer_modules, results["peers"] = peers.load(torch, args.peers, dev.cuda)
        results["peer_checks"] = {}
        results["meta"]["peers_import_s"] = round(time.perf_counter() - started, 1)
        for peer, entry in results["peers"].items():
            log(peers.status_line(peer, entry))
            if dev.cuda and not entry.get("ok"):
                results["failures"].append(f"peer {peer}: {entry.get('why')}")

    # -- ceilings
    copy_bytes = COPY_BYTES if dev.cuda else 64 << 20
    results["ceilings"] = ceilings(torch, dev, copy_bytes)
    copy_bps = results["ceilings"]["copy_Bps"]
    log(f"copy {copy_bps / 1e12:.3f} TB/s (read+write of {copy_bytes / 1e9:.1f} GB in "
        f"{results['ceilings']['copy_ms']:.3f} ms); read {results['ceilings']['read_Bps'] / 1e12:.3f} TB/s "
        f"[{elapsed_s():.0f} s]")

    def floor_ms(nbytes: int) -> float:
        return nbytes / copy_bps * 1e3

    # -- configs
    configs: Dict[str, KernelSet] = {}
    for directory in args.bundle:
        kset = open_config(rt, directory, keys, target)
        configs[kset.name] = kset
    default_name = next(iter(configs))
    sweep_sets: Dict[str, KernelSet] = {}
    for directory in args.sweep:
        kset = open_config(rt, directory, keys, target)
        sweep_sets[kset.name] = kset

    # -- sweep
    if sweep_sets:
        sweep_shapes = parse_shapes(args.sweep_shapes)
        sweep: Dict[str, Any] = {"configs": list(sweep_sets), "results": {}, "shapes": [shape_name(s) for s in sweep_shapes]}
        results["sweep"] = sweep
        for shape in sweep_shapes:
            sname = shape_name(shape)
            prob = Problem(torch, dev, shape[0], shape[1], args.seed)
            checker = Checker(torch, F, prob, args.seed)
            sweep["results"][sname] = {}
            for cname, kset in sweep_sets.items():
                try:
                    ours = Ours(cegen, rt, kset, prob, dev, ignore_index)
                    results["checks"][f"sweep {sname} {cname}"] = check_config(ours, checker, f"sweep {sname} {cname}")
                    steps = ours.steps()
                    entry = {}
                    for kernel in SWEEP_KERNELS:
                        step, setup = steps[kernel]
                        timing = time_step(dev, step, setup, args.sweep_reps)
                        passes = OUR_VARIANTS[kernel][0]
                        timing["pct_floor"] = 100.0 * floor_ms(passes * prob.bytes) / timing["ms"]
                        entry[kernel] = timing
                    prob.restore()
                    ours.check_labels()
                    sweep["results"][sname][cname] = entry
                    log(f"sweep {sname} {cname:10s} " + "  ".join(
                        f"{k} {entry[k]['ms']:.3f} ms ({entry[k]['pct_floor']:.0f}%)" for k in SWEEP_KERNELS)
                        + f"  [{elapsed_s():.0f} s]")
                except Exception as error:
                    results["failures"].append(f"sweep {sname} {cname}: {type(error).__name__}: {error}")
                    log(f"sweep {sname} {cname}: FAILED\n{traceback.format_exc()}")
                    prob.restore()
            del prob, checker
            if dev.cuda:
                torch.cuda.empty_cache()
            write_outputs(out, results)
        # best config per kernel: least sum over shapes of time / that shape's best time
        best: Dict[str, str] = {}
        for kernel in SWEEP_KERNELS:
            scores = {}
            for cname in sweep_sets:
                total = 0.0
                for sname, per_config in sweep["results"].items():
                    times = [c[kernel]["ms"] for c in per_config.values() if kernel in c]
                    mine = per_config.get(cname, {}).get(kernel)
                    if mine is None or not times:
                        total = math.inf
                        break
                    total += mine["ms"] / min(times)
                scores[cname] = total
            best[kernel] = min(scores, key=scores.get)
            sweep.setdefault("scores", {})[kernel] = scores
        sweep["best"] = best
        log(f"best per kernel: {best}")
        sources = {}
        for kernel, roles in ROLE_OF_SWEEP.items():
            for role in roles:
                sources[role] = sweep_sets[best[kernel]].sources[role]
        best_set = KernelSet("best", sources, keys)
        configs["best"] = best_set
        log("\n" + sweep_markdown(sweep, list(sweep["results"])))
        write_outputs(out, results)

    # -- full table
    compiled_fn = None
    eager_fn = lambda x, y: F.cross_entropy(x.float(), y, reduction="none")  # noqa: E731
    use_compile = dev.cuda and not args.no_torch and not args.no_compile and hasattr(torch, "compile")
    skipped = []
    for shape in parse_shapes(args.shapes):
        sname = shape_name(shape)
        if elapsed_s() > args.budget_s:
            skipped.append(sname)
            log(f"{sname}: SKIPPED (past the {args.budget_s:.0f} s budget)")
            continue
        prob = Problem(torch, dev, shape[0], shape[1], args.seed)
        checker = Checker(torch, F, prob, args.seed)
        shape_bytes = prob.bytes
        floors = {k: floor_ms(k * shape_bytes) for k in (1, 2, 3)}
        log(f"\n{sname}: logits {prob.bytes / 1e9:.2f} GB; floors 1/2/3 passes "
            f"{floors[1]:.3f}/{floors[2]:.3f}/{floors[3]:.3f} ms [{elapsed_s():.0f} s]")
        baseline: Dict[str, Dict[str, float]] = {"eager": {}, "compile": {}, "flash_ce": {}}

        def add_row(impl: str, variant: str, config: str, timing: Dict[str, Any], passes: int,
                    extra: Optional[int], vs: Optional[str] = None) -> None:
            row = {"shape": sname, "impl": impl, "variant": variant, "config": config,
                   "ms": timing["ms"], "min_ms": timing["min_ms"], "p10_ms": timing["p10_ms"],
                   "p90_ms": timing["p90_ms"], "reps": timing["reps"], "passes": passes,
                   "TBps": passes * shape_bytes / (timing["ms"] * 1e-3) / 1e12,
                   "pct_floor": 100.0 * floors[passes] / timing["ms"], "extra_bytes": extra}
            if vs is not None:
                for which in ("eager", "compile"):
                    base = baseline[which].get(vs)
                    row[f"vs_{which}"] = None if base is None else base / timing["ms"]
                if args.peers is not None and impl == "cegen":
                    base = baseline["flash_ce"].get(vs)
                    row["vs_flash_ce"] = None if base is None else base / timing["ms"]
            results["rows"].append(row)
            log(row_line(row, args.peers is not None))

        # torch baselines first: they leave the logits untouched
        if not args.no_torch:
            impls = [("torch eager", eager_fn)]
            if use_compile:
                try:
                    torch._dynamo.reset()
                    compiled_fn = torch.compile(eager_fn, dynamic=False)
                    started = time.perf_counter()
                    with torch.no_grad():
                        compiled_fn(prob.logits, prob.labels)
                    x = prob.logits.detach().requires_grad_(True)
                    torch.autograd.grad(compiled_fn(x, prob.labels), x, prob.grad_loss)
                    dev.sync()
                    del x
                    results["meta"].setdefault("compile_s", {})[sname] = round(time.perf_counter() - started, 1)
                    impls.append(("torch.compile", compiled_fn))
                except Exception as error:
                    results["failures"].append(f"torch.compile {sname}: {type(error).__name__}: {error}")
                    log(f"torch.compile {sname}: FAILED\n{traceback.format_exc()}")
            for impl, fn in impls:
                which = "eager" if impl == "torch eager" else "compile"
                try:
                    for variant, (step, setup) in torch_steps(torch, fn, prob).items():
                        timing = time_step(dev, step, setup, args.reps)
                        extra = dev.peak_extra(step, setup)
                        baseline[which][variant] = timing["ms"]
                        add_row(impl, variant, "-", timing, TORCH_VARIANTS[variant], extra)
                except Exception as error:
                    results["failures"].append(f"{impl} {sname}: {type(error).__name__}: {error}")
                    log(f"{impl} {sname}: FAILED\n{traceback.format_exc()}")
                if dev.cuda:
                    torch.cuda.empty_cache()

        # peers next (each leaves the logits pristine), so that our rows can be compared with them
        for peer, module in peer_modules.items():
            try:
                runner = peers.make(torch, peer, module, prob, ignore_index)
                check = runner.check(checker)
                results["peer_checks"][f"{sname} {peer}"] = check
                log(f"  {peer} check: {peers.check_line(check)}")
                for variant, config, passes, vs, step, setup in runner.cases():
                    prob.restore()
                    timing = time_step(dev, step, setup, args.reps)
                    extra = dev.peak_extra(step, setup)
                    if peer == peers.FLASH:
                        baseline["flash_ce"][variant] = timing["ms"]
                    add_row(peer, variant, config, timing, passes, extra, vs)
            except Exception as error:
                results["failures"].append(f"{peer} {sname}: {type(error).__name__}: {error}")
                log(f"{peer} {sname}: FAILED\n{traceback.format_exc()}")
            prob.restore()
            if dev.cuda:
                torch.cuda.empty_cache()

        for cname, kset in configs.items():
            try:
                ours = Ours(cegen, rt, kset, prob, dev, ignore_index)
                results["checks"][f"{sname} {cname}"] = check_config(ours, checker, f"{sname} {cname}")
                for variant, (step, setup) in ours.steps().items():
                    passes, vs = OUR_VARIANTS[variant]
                    timing = time_step(dev, step, setup, args.reps)
                    extra = dev.peak_extra(step, setup)
                    add_row("cegen", variant, cname, timing, passes, extra, vs)
                prob.restore()
                ours.check_labels()
            except Exception as error:
                results["failures"].append(f"cegen {sname} {cname}: {type(error).__name__}: {error}")
                log(f"cegen {sname} {cname}: FAILED\n{traceback.format_exc()}")
                prob.restore()
        del prob, checker
        if dev.cuda:
            torch.cuda.empty_cache()
        write_outputs(out, results)
    results["meta"]["skipped_shapes"] = skipped
    if "best" in configs:
        results["meta"]["best"] = configs["best"].describe()

    # -- host cost
    if not args.no_host_overhead:
        try:
            results["host_overhead"] = host_overhead(torch, F, cegen, rt, configs[default_name], dev,
                                                     ignore_index, args.seed)
        except Exception as error:
            results["failures"].append(f"host overhead: {type(error).__name__}: {error}")
            log(f"host overhead: FAILED\n{traceback.format_exc()}")

    # -- ceilings again (drift) and the summary
    try:
        again = ceilings(torch, dev, copy_bytes)
        results["ceilings_end"] = again
    except Exception as error:
        results["failures"].append(f"ceilings at the end: {error}")
    results["meta"]["nvidia_smi_end"] = nvidia_smi() if dev.cuda else ""
    results["failures"] += [f"check: {f}" for f in checker_failures(results)]
    results["meta"]["elapsed_s"] = round(elapsed_s(), 1)
    write_outputs(out, results)

    log("\n== summary ==")
    c = results["ceilings"]
    log(f"{results['meta'].get('device', args.device)}; copy {c['copy_Bps'] / 1e12:.2f} TB/s"
        + (f" (end {results['ceilings_end']['copy_Bps'] / 1e12:.2f})" if "ceilings_end" in results else "")
        + f"; read {c['read_Bps'] / 1e12:.2f} TB/s; floors = bytes / copy BW; "
          f"ratios = torch time / ours; ours via C API (ctypes)"
        + ("; vs flash_ce = flash_ce time / ours" if args.peers is not None else ""))
    if results["sweep"].get("best"):
        log(f"best per kernel: {results['sweep']['best']}")
    for peer, entry in results.get("peers", {}).items():
        log(peers.status_line(peer, entry))
    for name, check in results.get("peer_checks", {}).items():
        log(f"peer check {name}: {peers.check_line(check)}")
    log(table_head(args.peers is not None))
    for row in results["rows"]:
        if row["impl"] == "cegen" and row["variant"] in ("fwd", "bwd_ow", "fwd+bwd_ow", "fused_ow") \
                or row["impl"] != "cegen" and row["variant"] != "bwd":
            log(row_line(row, args.peers is not None))
    log("(all rows, bwd/fwd+bwd/fused without overwrite too: gpu_bench.md / gpu_bench.json)")
    if results["host_overhead"]:
        log("host us/call: " + "; ".join(f"{k}: {v}" for k, v in results["host_overhead"].items()))
    for failure in results["failures"]:
        log(f"FAILURE: {failure}")
    log(f"done in {elapsed_s():.0f} s; {len(results['failures'])} failure(s)")
    return 1 if results["failures"] else 0


def import_peers() -> Any:
    """bench/peers.py, also when this file is imported from elsewhere."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import peers

    return peers


def checker_failures(results: Dict[str, Any]) -> List[str]:
    failures = []
    for name, errs in results["checks"].items():
        for what, err in errs.items():
            limit = 1e-3 if what.endswith("loss") else 2e-2
            if not (isinstance(err, float) and err <= limit):
                failures.append(f"{name} {what}: rel err {err}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
