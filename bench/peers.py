"""Peer kernels for ``bench/gpu_bench.py --peers DIR`` (issue #7): flash-attention's Triton cross
entropy and Liger-Kernel's, imported unmodified from their upstream sources under DIR.

DIR is put first on ``sys.path`` and must hold (never committed; see ``.dev/peers/SOURCES.md``)::

    flash_attn/__init__.py                  empty (the real one loads the CUDA extension)
    flash_attn/ops/__init__.py              upstream (empty)
    flash_attn/ops/triton/__init__.py       upstream
    flash_attn/ops/triton/cross_entropy.py  upstream
    liger_kernel/__init__.py                upstream (empty)
    liger_kernel/ops/__init__.py            empty (the real one imports every op)
    liger_kernel/ops/cross_entropy.py       upstream
    liger_kernel/ops/utils.py               upstream
    liger_kernel/utils.py                   upstream

Each peer is imported behind a guard: one that cannot be imported (or, on ``--device cpu``,
cannot run: its kernels are Triton's, for CUDA) is reported with the reason and skipped.

What is timed (by gpu_bench's own ``time_step`` / ``Dev.peak_extra``, on gpu_bench's inputs):

* ``flash_ce``: ``cross_entropy_loss(logits, labels, ignore_index=...)`` (per-token fp32
  loss, no reduction); ``fwd`` under no_grad; ``fwd+bwd`` = the call on a leaf that requires
  grad, then ``torch.autograd.grad`` with the per-token upstream gradient, with
  ``inplace_backward=False`` (gradient into a new buffer) and, as ``fwd+bwd_ow``,
  ``inplace_backward=True`` (gradient over the logits; restored untimed before each call).
  Floor: 1 pass for fwd, 3 for fwd+bwd (two kernels, as torch's and our unfused fwd+bwd).
* ``liger_ce``: ``LigerCrossEntropyFunction.apply(logits, labels, None, ignore_index, 0.0, 0.0,
  reduction)[0]`` with reduction ``none`` (upstream gradient: the per-token values, cast to the
  loss's dtype, bf16, as autograd would) and ``mean`` (upstream gradient 1.0). Its forward
  kernel writes the gradient over the logits whenever they require grad, so every fwd+bwd call
  is preceded by the untimed restore; with ``none`` its backward then multiplies by the
  upstream gradient into a new buffer. Floor: 1 pass for fwd, 2 for fwd+bwd (one fused
  kernel, as our fused). Its forward also reads ``.item()`` and checks the labels on the host:
  those synchronisations are part of the time, as in any use of it.

Checks (untimed, reported, never a failure): the max abs difference of each loss from the fp32
``F.cross_entropy`` loss (for reduction mean: of the scalar from the mean of that loss), and the
gradient's largest relative error on gpu_bench's sampled rows against its float64 reference.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

FLASH = "flash_ce"
LIGER = "liger_ce"
MODULES = {FLASH: "flash_attn.ops.triton.cross_entropy", LIGER: "liger_kernel.ops.cross_entropy"}

Step = Callable[[], Any]
# (variant, config, floor passes, torch variant it is compared with, step, setup)
Case = Tuple[str, str, int, str, Step, Optional[Step]]


def git_blob(path: str) -> str:
    """The file's git blob id, to match against the upstream commit named in SOURCES.md."""
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _import(name: str) -> Tuple[Any, Optional[str]]:
    """The module, and a note when it took the second try."""
    try:
        return importlib.import_module(name), None
    except Exception as error:
        # liger_kernel.utils imports peft (for other ops) and catches only ImportError: if an
        # installed peft fails otherwise, import again with peft marked absent.
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        if not name.startswith("liger_kernel") or "peft" not in trace:
            raise
        sys.modules["peft"] = None  # type: ignore[assignment]
        for loaded in [m for m in sys.modules if m.startswith("liger_kernel")]:
            del sys.modules[loaded]
        return importlib.import_module(name), f"imported with peft blocked ({type(error).__name__}: {error})"


def load(torch: Any, directory: str, cuda: bool) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """Imports each peer from ``directory``; returns ({peer: module}, {peer: status for the output})."""
    root = Path(directory).resolve()
    modules: Dict[str, Any] = {}
    status: Dict[str, Dict[str, Any]] = {}
    if not root.is_dir():
        for peer in MODULES:
            status[peer] = {"ok": False, "why": f"no directory {root}"}
        return modules, status
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for peer, name in MODULES.items():
        try:
            module, note = _import(name)
            where = str(Path(module.__file__).resolve())
            entry: Dict[str, Any] = {"ok": True, "module": name, "file": where, "blob": git_blob(where)}
            if not where.startswith(str(root)):
                entry["note"] = f"imported from {where}, not from {root}"
            if note:
                entry["note"] = note
            if peer == FLASH:
                module.cross_entropy_loss  # noqa: B018  (the entry point must exist)
            else:
                module.LigerCrossEntropyFunction  # noqa: B018
            if not cuda:
                entry.update(ok=False, why="imported, but its Triton kernels need CUDA")
            else:
                modules[peer] = module
            status[peer] = entry
        except Exception as error:
            status[peer] = {"ok": False, "module": name,
                            "why": f"import failed: {type(error).__name__}: {error}"}
    return modules, status


def status_line(peer: str, entry: Dict[str, Any]) -> str:
    if entry.get("ok"):
        text = f"{peer}: {entry['module']} from {entry['file']} (blob {entry['blob'][:12]})"
    else:
        text = f"{peer}: UNAVAILABLE: {entry['why']}"
    return text + (f"; {entry['note']}" if entry.get("note") else "")


# -- the peers' calls ----------------------------------------------------------------------------


class Peer:
    def __init__(self, torch: Any, module: Any, prob: Any, ignore_index: Optional[int]):
        self.torch, self.module, self.p = torch, module, prob
        # labels never take it; the peers need an int (F.cross_entropy's default otherwise)
        self.ignore_index = -100 if ignore_index is None else ignore_index

    def leaf(self) -> Any:
        return self.p.logits.detach().requires_grad_(True)


class Flash(Peer):
    def call(self, logits: Any, inplace: bool = False) -> Any:
        loss, _z_loss = self.module.cross_entropy_loss(logits, self.p.labels, ignore_index=self.ignore_index,
                                                       inplace_backward=inplace)
        return loss

    def cases(self) -> List[Case]:
        torch, p = self.torch, self.p
        x = self.leaf()

        def fwd() -> None:
            with torch.no_grad():
                self.call(p.logits)

        def fwd_bwd(inplace: bool) -> None:
            torch.autograd.grad(self.call(x, inplace), x, p.grad_loss)

        return [("fwd", "-", 1, "fwd", fwd, None),
                ("fwd+bwd", "inplace_backward=False", 3, "fwd+bwd", lambda: fwd_bwd(False), None),
                ("fwd+bwd_ow", "inplace_backward=True", 3, "fwd+bwd", lambda: fwd_bwd(True), p.restore)]

    def check(self, checker: Any) -> Dict[str, Any]:
        torch, p = self.torch, self.p
        out: Dict[str, Any] = {}
        p.restore()
        with torch.no_grad():
            loss = self.call(p.logits)
        out["loss_dtype"] = str(loss.dtype).replace("torch.", "")
        out["loss_max_abs"] = max_abs(loss, checker.ref_loss)
        for inplace in (False, True):
            x = self.leaf()
            (grad,) = torch.autograd.grad(self.call(x, inplace), x, p.grad_loss)
            out["ow_grad_rel" if inplace else "grad_rel"] = checker.grad("", grad)
            del grad, x
            p.restore()
        return out


class Liger(Peer):
    def call(self, logits: Any, reduction: str) -> Any:
        # positional: the first seven arguments have kept their order across Liger's releases
        return self.module.LigerCrossEntropyFunction.apply(
            logits, self.p.labels, None, self.ignore_index, 0.0, 0.0, reduction)[0]

    def upstream(self, loss: Any, reduction: str, held: Dict[Any, Any]) -> Any:
        """The per-token gradient in the loss's dtype (made once), or 1.0 for a reduced loss."""
        key = (reduction, loss.dtype)
        if key not in held:
            held[key] = (self.p.grad_loss.to(loss.dtype) if reduction == "none"
                         else self.torch.ones((), dtype=loss.dtype, device=loss.device))
        return held[key]

    def cases(self) -> List[Case]:
        torch, p = self.torch, self.p
        x = self.leaf()
        held: Dict[Any, Any] = {}

        def fwd(reduction: str) -> None:
            with torch.no_grad():
                self.call(p.logits, reduction)

        def fwd_bwd(reduction: str) -> None:
            loss = self.call(x, reduction)
            torch.autograd.grad(loss, x, self.upstream(loss, reduction, held))

        # the forwards first: each fwd+bwd leaves gradients in the logits (gpu_bench also
        # restores them before each case)
        return ([("fwd", f"reduction={r}", 1, "fwd", lambda r=r: fwd(r), None) for r in ("none", "mean")]
                + [("fwd+bwd", f"reduction={r}", 2, "fwd+bwd", lambda r=r: fwd_bwd(r), p.restore)
                   for r in ("none", "mean")])

    def check(self, checker: Any) -> Dict[str, Any]:
        torch, p = self.torch, self.p
        out: Dict[str, Any] = {}
        held: Dict[Any, Any] = {}
        rows = checker.rows
        for reduction in ("none", "mean"):
            p.restore()
            with torch.no_grad():
                loss = self.call(p.logits, reduction)
            out[f"{reduction}_loss_dtype"] = str(loss.dtype).replace("torch.", "")
            if reduction == "none":
                out["none_loss_max_abs"] = max_abs(loss, checker.ref_loss)
            else:
                out["mean_loss_abs"] = abs(float(loss.double()) - float(checker.ref_loss.double().mean()))
            x = self.leaf()
            loss = self.call(x, reduction)
            (grad,) = torch.autograd.grad(loss, x, self.upstream(loss, reduction, held))
            if reduction == "none":
                out["none_grad_rel"] = checker.grad("", grad)
            else:
                # d mean / d logits = (softmax - onehot) / N: scale to the reference's per-token form
                ours = grad[rows].double() * p.n * p.grad_loss[rows].double()[:, None]
                out["mean_grad_rel"] = rel_rows(ours, checker.ref_grad)
            del grad, x, loss
            p.restore()
        return out


def max_abs(loss: Any, ref: Any) -> float:
    return float((loss.double() - ref.double()).abs().max())


def rel_rows(ours: Any, ref: Any) -> float:
    """gpu_bench's Checker.grad on rows already taken."""
    scale = ref.abs().amax(dim=1, keepdim=True)
    return float(((ours - ref).abs() / (ref.abs() + 1e-6 * scale)).max())


PEERS = {FLASH: Flash, LIGER: Liger}


def make(torch: Any, peer: str, module: Any, prob: Any, ignore_index: Optional[int]) -> Peer:
    return PEERS[peer](torch, module, prob, ignore_index)


def check_line(values: Dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
