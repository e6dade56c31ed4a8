"""One rank of the process groups that test_tensor_parallel.py starts (not a unittest module).

Usage (the test runs it; by hand only to debug)::

    python3 _tensor_parallel_worker.py --rank R --world W --port P --inputs IN.pt \
        --output OUT.pt --cache-dir DIR

It joins a gloo group through the TCP store the test holds on 127.0.0.1:P, runs every
case of ``IN.pt`` on its vocabulary slice of the logits with
``cegen.vocab_parallel_cross_entropy`` (with W = 2 also the Megatron stand-in: the patched
loss, and GPTModel with the fused output layer against its unfused post-processing; with a
"linear" entry, test_linear_cross_entropy.py's cases of ``cegen.linear_cross_entropy``, see
``_linear_parallel_cases.py``), and saves what each case returned (loss, gradient slice,
errors, warnings) to ``OUT.pt``; the test compares them. A case that raises is recorded, not
fatal: every rank raises alike (the inputs are the same), so no rank is left waiting in a
collective.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent / "python"), str(HERE / "megatron_standin")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cegen  # noqa: E402
from cegen import _kernels  # noqa: E402
from _fresh_logits import MakeLogits as FreshLogits  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=120)


def vocab_slice(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s equal slice of the last dimension, contiguous."""
    local = full.shape[-1] // world
    return full[..., rank * local:(rank + 1) * local].contiguous()


def run_case(case: Dict[str, Any], rank: int, world: int, group: Any) -> Dict[str, Any]:
    """One case on this rank: loss, gradient slice, refusal warnings, or the error."""
    logits = vocab_slice(case["logits"], rank, world)
    labels, weights, options = case["labels"], case["weights"], dict(case["options"])
    overwrite = options.pop("overwrite_input", False)
    FreshLogits.output_pointers.clear()
    FreshLogits.grad_pointers.clear()
    cegen.reset_overwrite_warnings()
    try:
        with warnings.catch_warnings(record=True) as caught, _kernels.poison_outputs():
            warnings.simplefilter("always")
            if case["no_grad"]:
                with torch.no_grad():
                    loss = cegen.vocab_parallel_cross_entropy(logits, labels, group=group, **options)
                grad = None
            else:
                x = logits.clone().requires_grad_(True)
                if overwrite:
                    # A temporary, as a model's output is handed to its loss; keywords spelled
                    # out: a **mapping call holds one more reference to the positional logits.
                    loss = cegen.vocab_parallel_cross_entropy(
                        FreshLogits.apply(x), labels, group=group, overwrite_input=True,
                        ignore_index=options["ignore_index"],
                        label_smoothing=options["label_smoothing"], z_loss=options["z_loss"],
                        global_smoothing=options["global_smoothing"],
                        label_layout=options["label_layout"],
                        label_out_of_range=options["label_out_of_range"])
                else:
                    loss = cegen.vocab_parallel_cross_entropy(x, labels, group=group, **options)
                (loss * weights).sum().backward()
                grad = x.grad
    except Exception as error:  # recorded: the test checks which error every rank got
        return {"error": type(error).__name__, "message": str(error),
                "traceback": traceback.format_exc()}
    return {
        "loss": loss.detach(),
        "grad": grad,
        "refused": [str(w.message) for w in caught if issubclass(w.category, cegen.OverwriteRefusedWarning)],
        "in_place": (bool(FreshLogits.output_pointers)
                     and FreshLogits.grad_pointers == FreshLogits.output_pointers),
    }


def run_outputs(spec: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """``return_lse/return_entropy/return_argmax`` of ``vocab_parallel_cross_entropy`` on
    this rank's slice: the combined outputs and the loss's gradient slice, or the error."""
    logits = vocab_slice(spec["logits"], rank, world).requires_grad_(True)
    try:
        with _kernels.poison_outputs():
            result = cegen.vocab_parallel_cross_entropy(
                logits, spec["labels"], logit_scale=spec["logit_scale"],
                logit_softcap=spec.get("logit_softcap"),
                label_out_of_range="megatron", return_lse=True, return_entropy=True,
                return_argmax=True)
            result.loss.sum().backward()
    except Exception as error:  # recorded, as run_case does
        return {"error": type(error).__name__, "message": str(error),
                "traceback": traceback.format_exc()}
    return {"loss": result.loss.detach(), "lse": result.lse, "entropy": result.entropy,
            "argmax": result.argmax, "grad": logits.grad}


class ListHandler(logging.Handler):
    """Keeps the messages of a logger."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_megatron(spec: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """The Megatron stand-in at TP = ``world``: patched (cegen) and original, its loss and
    the gradient of this rank's output-weight rows; also on SFT labels (-100 prompts and
    other ids outside the vocabulary), with the ``native`` and the ``te`` implementation."""
    from cegen import megatron as turbo_ce
    from megatron.core import parallel_state
    from megatron.core.models.common.language_module import language_module
    from megatron.core.models.gpt.gpt_model import TinyGPTModel
    from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden, weight = spec["hidden"], spec["weight"]
    tp_group = dist.new_group(list(range(world)))  # a group of its own, as Megatron makes
    handler = ListHandler()
    logging.getLogger("cegen.megatron").addHandler(handler)

    def step(tp: Any, overwrite: Optional[bool], from_parallel_state: bool = False,
             labels: Any = spec["labels"], mask: Any = spec["mask"],
             impl: str = "native") -> Dict[str, Any]:
        """One forward and backward of ``(loss * mask).sum() / mask.sum()``; overwrite None
        runs Megatron's (the stand-in's) own."""
        config = TransformerConfig(tensor_model_parallel_size=world, cross_entropy_loss_fusion=True,
                                   cross_entropy_fusion_impl=impl)
        turbo_ce.uninstall()
        turbo_ce.reset_fallback_log()
        cegen.reset_overwrite_warnings()
        if overwrite is not None:
            turbo_ce.install(turbo_ce.TurboCESettings(True, overwrite))
        language_module.CALLS["compute_language_model_loss"] = 0
        handler.messages.clear()
        groups = ProcessGroupCollection(tp=tp, cp=FakeProcessGroup(1), pp=FakeProcessGroup(1),
                                        embd=None)
        rows = weight.shape[0] // world
        module = TinyGPTModel(config, hidden_size=hidden.shape[-1], vocab_size=weight.shape[0],
                              pg_collection=groups,
                              output_weight=weight[rank * rows:(rank + 1) * rows].clone())
        if from_parallel_state:  # the module knows no group: only parallel_state has it
            module.tp_group = module.pg_collection.tp = None
            parallel_state.set_tensor_model_parallel_group(tp)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = module(hidden, labels)
                ((loss * mask).sum() / mask.sum()).backward()
        finally:
            parallel_state.set_tensor_model_parallel_group(None)
        return {
            "loss": loss.detach(),
            "grad": module.output_weight.grad,
            "original_calls": language_module.CALLS["compute_language_model_loss"],
            "logged": list(handler.messages),
            "refused": [str(w.message) for w in caught
                        if issubclass(w.category, cegen.OverwriteRefusedWarning)],
        }

    results = {
        "patched": step(tp_group, overwrite=False),
        "patched_overwrite": step(tp_group, overwrite=True),
        "patched_parallel_state": step(tp_group, overwrite=False, from_parallel_state=True),
        "original": step(tp_group, overwrite=None),
        "fake_group": step(FakeProcessGroup(world, rank), overwrite=False),
    }
    sft = {"labels": spec["sft_labels"], "mask": spec["sft_mask"]}
    weighted = {"labels": spec["sft_labels"], "mask": spec["sft_weights"]}
    prompts = {"labels": spec["prompt_labels"], "mask": spec["sft_weights"]}
    for impl in ("native", "te"):
        results[f"sft_{impl}"] = step(tp_group, overwrite=False, impl=impl, **sft)
        results[f"sft_{impl}_overwrite"] = step(tp_group, overwrite=True, impl=impl, **sft)
        results[f"sft_{impl}_weighted"] = step(tp_group, overwrite=False, impl=impl, **weighted)
        results[f"prompts_{impl}"] = step(tp_group, overwrite=False, impl=impl, **prompts)
        results[f"prompts_{impl}_original"] = step(tp_group, overwrite=None, impl=impl, **prompts)
    results["sft_native_original"] = step(tp_group, overwrite=None, **weighted)
    turbo_ce.uninstall()
    logging.getLogger("cegen.megatron").removeHandler(handler)
    return results


#: GPTModel variants of the fused output layer at TP = 2 (run_megatron_output_layer).
OUTPUT_LAYER_VARIANTS = {
    "plain": {},
    "tied": {"share": True},
    "bias": {"bias": True},
    "sequence_parallel": {"sequence_parallel": True},
    "sequence_parallel_tied_bias": {"sequence_parallel": True, "share": True, "bias": True},
    "te_sft": {"impl": "te", "labels": "sft_labels"},
    "native_sft_fused_gradient": {"labels": "sft_labels", "fused_gradient": True},
    "sequence_parallel_fused_gradient": {"sequence_parallel": True, "fused_gradient": True},
}


def run_megatron_output_layer(spec: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """The stand-in's GPTModel at TP = ``world`` per variant: with --turbo-ce-fuse-output-layer
    (float32, cegen.linear_cross_entropy) and without cegen (the stand-in's output layer and
    loss, float64; for ``te`` Core's loss with -100 zeroed, what cegen gives). Each returns
    this rank's loss, d hidden (its sequence rows under sequence parallelism), d weight and
    d bias rows, the output layer's runs, the recomputes and the fallback log."""
    import functools
    from unittest import mock

    from cegen import linear
    from cegen import megatron as turbo_ce
    from megatron.core.models.gpt import gpt_model
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp_group = dist.new_group(list(range(world)))
    handler = ListHandler()
    logging.getLogger("cegen.megatron").addHandler(handler)
    rows = spec["weight"].shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)

    def pretrain_loss_func(loss_mask, output_tensor):  # type: ignore[no-untyped-def]
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        return (torch.sum(losses * loss_mask), loss_mask.sum().clone().detach().to(torch.int),
                {})

    def step(variant: Dict[str, Any], fused: bool) -> Dict[str, Any]:
        impl = variant.get("impl", "native")
        sequence_parallel = variant.get("sequence_parallel", False)
        dtype = torch.float32 if fused else torch.float64
        config = TransformerConfig(tensor_model_parallel_size=world, cross_entropy_loss_fusion=True,
                                   cross_entropy_fusion_impl=impl if fused else "native",
                                   sequence_parallel=sequence_parallel,
                                   grad_scale_func=lambda loss: loss * 1024.0)
        groups = ProcessGroupCollection(tp=tp_group, cp=FakeProcessGroup(1), pp=FakeProcessGroup(1),
                                        embd=None)
        turbo_ce.uninstall()
        turbo_ce.reset_fallback_log()
        if fused:
            turbo_ce.install(turbo_ce.TurboCESettings(
                use_turbo_cross_entropy=True, turbo_ce_fuse_output_layer=True,
                turbo_ce_fused_gradient=variant.get("fused_gradient", False)))
        model = gpt_model.GPTModel(config, spec["hidden"].shape[-1], spec["weight"].shape[0],
                                   pg_collection=groups,
                                   share_embeddings_and_output_weights=variant.get("share", False),
                                   bias=variant.get("bias", False), dtype=dtype,
                                   output_weight=spec["weight"][mine].to(dtype).clone())
        if variant.get("bias", False):
            with torch.no_grad():
                model.output_layer.bias.copy_(spec["bias"][mine].to(dtype))
        hidden = spec["hidden"]
        if sequence_parallel:  # this rank's rows of the sequence
            seq = hidden.shape[0] // world
            hidden = hidden[rank * seq:(rank + 1) * seq]
        hidden = hidden.to(dtype).clone().requires_grad_(True)
        labels = spec[variant.get("labels", "labels")]
        calls = gpt_model.CALLS["output_layer"]
        recomputes = [0]
        real = linear._recompute_grads

        def counted(*args: Any, **kwargs: Any) -> Any:
            recomputes[0] += 1
            return real(*args, **kwargs)

        handler.messages.clear()
        with mock.patch.object(linear, "_recompute_grads", counted):
            loss = model(hidden, labels, loss_mask=spec["mask"])
            if impl == "te" and not fused:  # TE's -100: loss 0 and no gradient
                loss = torch.where(labels == -100, torch.zeros_like(loss), loss)
            if variant.get("fused_gradient", False):  # Megatron's step: loss_func, schedule
                output, _ = schedules.forward_step_calc_loss(
                    loss, functools.partial(pretrain_loss_func, spec["mask"]), config, 1)
                schedules.backward_step(output, config)
            else:
                (loss * spec["upstream"].to(loss.dtype)).sum().backward()
        weight = (model.embedding.word_embeddings.weight if variant.get("share", False)
                  else model.output_layer.weight)
        bias = model.output_layer.bias
        turbo_ce.uninstall()
        return {"loss": loss.detach(), "grad_hidden": hidden.grad, "grad_weight": weight.grad,
                "grad_bias": None if bias is None else bias.grad,
                "output_layer_runs": gpt_model.CALLS["output_layer"] - calls,
                "recomputes": recomputes[0], "logged": list(handler.messages)}

    results = {}
    for name, variant in OUTPUT_LAYER_VARIANTS.items():
        try:
            results[name] = {"fused": step(variant, True), "unfused": step(variant, False)}
        except Exception as error:  # recorded; every rank raises alike
            results[name] = {"error": type(error).__name__, "traceback": traceback.format_exc()}
    logging.getLogger("cegen.megatron").removeHandler(handler)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    args = parser.parse_args()

    cegen.configure(cache_dir=args.cache_dir)
    store = dist.TCPStore("127.0.0.1", args.port, None, False, TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                            timeout=TIMEOUT)
    inputs = torch.load(args.inputs)
    results: Dict[str, Any] = {}
    for case in inputs.get("cases", []):
        results[case["name"]] = run_case(case, args.rank, args.world, None)
    if args.world == 4 and "subgroup_cases" in inputs:
        # Two tensor-parallel groups of two (data parallel x TP): ranks within each group.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for case in inputs["cases"]:
            if case["name"] in inputs["subgroup_cases"]:
                results["pairs/" + case["name"]] = run_case(case, args.rank % 2, 2,
                                                            pairs[args.rank // 2])
    if args.world == 2 and "megatron" in inputs:
        results["megatron"] = run_megatron(inputs["megatron"], args.rank, args.world)
    if args.world == 2 and "megatron_output_layer" in inputs:
        results["megatron_output_layer"] = run_megatron_output_layer(
            inputs["megatron_output_layer"], args.rank, args.world)
    for name in ("outputs", "outputs_softcap"):
        if name in inputs:
            results[name] = run_outputs(inputs[name], args.rank, args.world)
    if "linear" in inputs:  # test_linear_cross_entropy.py's vocab-parallel weights
        from _linear_parallel_cases import run_cases

        results["linear"] = run_cases(inputs["linear"], args.rank, args.world)
    dist.barrier()
    torch.save(results, args.output)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
