"""The cases of cegen.linear_cross_entropy with vocab-parallel weights, shared by the test
(test_linear_cross_entropy.py, which builds them and checks the results) and the ranks of its
gloo groups (_tensor_parallel_worker.py, which runs them): each case's slice bounds, options,
schedule and upstream gradient, and :func:`run_cases`, one rank's side (not a unittest module).
"""

from __future__ import annotations

import traceback
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import torch

#: Schedules: how grad_weights and the backward's upstream gradient relate.
#: "recompute": no grad_weights, a per-token upstream; "fused-match": the backward gets the
#: grad_weights tensor itself (the forward's gradients are the answer where the rows'
#: layout keeps its memory: [N] rows; in [S, B, H]'s an equal copy, a multiple by 1);
#: "fused-differ": grad_weights twice it (the backward scales d weight by the factor 1/2 it
#: finds on the device); "fused-exact": the same with grad_weights_exact=True (the backward
#: recomputes d weight); "mean": grad_weights 1/N and loss.mean() (a contiguous upstream of
#: 1/N, one factor on the device); "sum": loss.sum()
#: (a stride-0 upstream); "zeros": a zero upstream; "no-grad": the forward alone;
#: "fused-twice": "fused-match" with two backward passes of a retained graph (the gradients
#: add up; the second pass recomputes everything); "reduced": reduction="mean" (the 0-d
#: loss's backward scales the forward's gradients; the per-token loss of a second, no-grad
#: call is what is compared, the mean besides).
SCHEDULES = ("recompute", "fused-match", "fused-differ", "fused-exact", "mean", "sum", "zeros",
             "no-grad", "fused-twice", "reduced")


def slice_bounds(vocab: int, world: int, uneven: bool) -> List[Tuple[int, int]]:
    """Each rank's [start, end) of the vocabulary: equal slices, or sizes base + 2, base,
    ..., base - 2 (the first rank's largest) when ``uneven``."""
    base = vocab // world
    if not uneven:
        assert base * world == vocab, (vocab, world)
        sizes = [base] * world
    else:
        sizes = [base] * world
        sizes[0] += 2
        sizes[-1] -= 2
        sizes[0] += vocab - sum(sizes)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def case(name: str, *, schedule: str, chunk: int, layout: str = "rows", bias: bool = True,
         uneven: bool = False, labels: str = "plain", ignore_index: Optional[int] = -100,
         label_smoothing: float = 0.1, z_loss: float = 1e-3, global_smoothing: bool = True,
         reduce_grad_hidden: bool = True) -> Dict[str, Any]:
    """One call every rank makes. ``labels``: "plain" (two ignored tokens across the first
    boundaries), "sft" (Megatron's ids outside the vocabulary, label_out_of_range="megatron")
    or "bad" (one id outside the vocabulary: LabelOutOfRangeError on every rank)."""
    assert schedule in SCHEDULES, schedule
    return {"name": name, "schedule": schedule, "chunk": chunk, "layout": layout, "bias": bias,
            "uneven": uneven, "labels": labels, "reduce_grad_hidden": reduce_grad_hidden,
            "options": {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
                        "z_loss": z_loss, "global_smoothing": global_smoothing,
                        "label_out_of_range": "megatron" if labels == "sft" else "error"}}


def inputs_of(spec: Dict[str, Any], case_: Dict[str, Any]) -> Dict[str, Any]:
    """The case's hidden, labels and upstream gradient (float64; the ranks cast)."""
    if case_["layout"] == "sbh":
        hidden, labels, upstream = spec["hidden_sbh"], spec["labels_bs"], spec["upstream_bs"]
        if case_["labels"] == "sft":
            labels = spec["sft_labels_bs"]
    else:
        hidden, labels, upstream = spec["hidden"], spec["labels"], spec["upstream"]
        if case_["labels"] == "sft":
            labels = spec["sft_labels"]
        elif case_["labels"] == "bad":
            labels = spec["bad_labels"]
    schedule = case_["schedule"]
    count = labels.numel()
    grad_weights: Any = None
    if schedule in ("fused-match", "fused-twice"):
        grad_weights = upstream.float()
    elif schedule in ("fused-differ", "fused-exact"):
        grad_weights = (2 * upstream).float()
    elif schedule == "mean":
        grad_weights = 1.0 / count
        upstream = torch.full_like(upstream, 1.0 / count)
    elif schedule == "sum":
        upstream = torch.ones_like(upstream)
    elif schedule == "zeros":
        upstream = torch.zeros_like(upstream)
    elif schedule == "reduced":  # the mean over the tokens not ignored
        ignore_index = case_["options"]["ignore_index"]
        kept = count if ignore_index is None else int((labels != ignore_index).sum())
        upstream = torch.full_like(upstream, 1.0 / max(1, kept))
    return {"hidden": hidden, "labels": labels, "upstream": upstream,
            "grad_weights": grad_weights}


def run_one(spec: Dict[str, Any], case_: Dict[str, Any], rank: int, world: int,
            group: Any) -> Dict[str, Any]:
    """This rank's loss, d hidden, d weight slice and d bias slice (float32 inputs)."""
    import cegen
    from cegen import linear

    data = inputs_of(spec, case_)
    start, end = slice_bounds(spec["weight"].shape[0], world, case_["uneven"])[rank]
    hidden = data["hidden"].float().clone().requires_grad_(True)
    weight = spec["weight"][start:end].float().clone().requires_grad_(True)
    bias = spec["bias"][start:end].float().clone().requires_grad_(True) if case_["bias"] else None
    extra = {}
    if case_["uneven"]:
        extra = {"vocab_start": start, "vocab_size": spec["weight"].shape[0]}
    recomputes = [0]
    real = linear._recompute_grads

    def counted(*args: Any, **kwargs: Any) -> Any:
        recomputes[0] += 1
        return real(*args, **kwargs)

    try:
        with mock.patch.object(linear, "_recompute_grads", counted):
            schedule = case_["schedule"]
            with torch.set_grad_enabled(schedule != "no-grad"):
                loss = cegen.linear_cross_entropy(
                    hidden, weight, data["labels"], bias=bias, chunk_tokens=case_["chunk"],
                    grad_weights=data["grad_weights"], tp_group=group,
                    grad_weights_exact=schedule == "fused-exact",
                    reduce_grad_hidden=case_["reduce_grad_hidden"],
                    reduction="mean" if schedule == "reduced" else "none", **case_["options"],
                    **extra)
            if schedule == "reduced":
                reduced = loss.detach()
                loss.backward()
                with torch.no_grad():
                    loss = cegen.linear_cross_entropy(
                        hidden, weight, data["labels"], bias=bias, chunk_tokens=case_["chunk"],
                        tp_group=group, **case_["options"], **extra)
            elif schedule == "mean":
                loss.mean().backward()
            elif schedule == "sum":
                loss.sum().backward()
            elif schedule == "fused-twice":  # grad_weights itself, then again
                loss.backward(data["grad_weights"], retain_graph=True)
                loss.backward(data["grad_weights"])
            elif schedule == "fused-match":  # the backward gets grad_weights itself
                loss.backward(data["grad_weights"])
            elif schedule != "no-grad":
                loss.backward(data["upstream"].float())
    except Exception as error:  # recorded: every rank raises alike, none waits in a collective
        return {"error": type(error).__name__, "message": str(error),
                "traceback": traceback.format_exc()}
    return {"loss": loss.detach(), "grad_hidden": hidden.grad, "grad_weight": weight.grad,
            "grad_bias": None if bias is None else bias.grad, "recomputes": recomputes[0],
            "reduced": reduced if case_["schedule"] == "reduced" else None}


def run_cases(spec: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Every case on this rank, over a group of all ``world`` ranks (made here)."""
    group = torch.distributed.new_group(list(range(world)))
    return {case_["name"]: run_one(spec, case_, rank, world, group) for case_ in spec["cases"]}
