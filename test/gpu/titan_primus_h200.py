#!/usr/bin/env python3
"""cegen in real TorchTitan (v0.2.2) and cegen's Primus patch on real Megatron-Core, on a GPU.

Not a CI test (CI tests both against stand-ins: test/python/test_torchtitan.py and
test_primus.py). This needs a CUDA GPU and the folder test/gpu/prepare_titan_primus_run.sh
makes under .dev/gpu20 (git-ignored, never committed): TorchTitan v0.2.2's ``torchtitan``
package (the version Primus pins) in titan/, Megatron-LM d98e8a6's ``megatron/core`` in
megatron/, Primus fd1eeab's ``primus`` package in primus/, lib/libce_runtime.so and two sm_90
bundles. Run::

    python3 test/gpu/titan_primus_h200.py --src .dev/gpu20 --out $OUT/titan_primus.json

Part 1, TorchTitan: the real ``torchtitan.train.Trainer`` (llama3 ``debugmodel``, V = 32000,
one GPU, bf16 autocast as TorchTitan sets it up for single-device training) built from a
TrainSpec that names ``cegen.torchtitan.build_cross_entropy_loss`` (the real llama3 spec with
a synthetic-data loader builder and no tokenizer), its real ``train_step`` for STEPS steps of
two microbatches (gradient accumulation), from the same weights, three times: cegen's loss,
TorchTitan's own ``build_cross_entropy_loss``, and cegen's with ``cegen.overwrite_input``
(the job config extended by TorchTitan's own ``ConfigManager._merge_configs`` with
``cegen.torchtitan.JobConfig``). Recorded: every step's loss, the first step's gradients of
every parameter, overwrite refusals, whether the gradient arrived in the logits' storage, and
the DTensor fallback (vocabulary-sharded DTensor logits under ``loss_parallel``, logged once,
TorchTitan's loss computing it). The GPU image lacks three of TorchTitan's dependencies and
has no package index: ``tyro`` (command-line parsing), ``torchdata`` (its stateful data
loader) and ``datasets`` (Hugging Face data sets); where one cannot be imported, an import
stand-in is put in its place (``tyro.constructors``' names, ``StatefulDataLoader`` =
``torch.utils.data.DataLoader``, ``datasets`` functions that raise), which this run never
calls: the job config is built as a dataclass, not parsed, and the data come from the
synthetic loader. The result lists which were stood in.

Part 2, Primus on Megatron-Core: Primus's real patch registry (``primus.core.patches``) with
cegen.primus registered; ``run_patches(backend="megatron", phase="before_train")`` with the
module parameters a YAML/command line gives (``use_turbo_cross_entropy``,
``turbo_ce_overwrite_input``) patches real Megatron-Core's LanguageModule; a small real
``GPTModel`` (bf16, local layer spec, Float16Module): per-token loss and every parameter's
gradient against Megatron's own fused loss, overwrite-input through Megatron's caller, then
STEPS AdamW steps patched and unpatched from the same weights.

Paths are arguments (the cegen package reads no environment variable).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import logging
import os
import socket
import sys
import tempfile
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ, BATCH, STEPS = 32000, 512, 4, 8
MEGATRON_SEQ = 256


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def stand_in_missing_modules() -> List[str]:
    """Import stand-ins for TorchTitan's dependencies this image lacks (never called here)."""
    stood_in = []
    if importlib.util.find_spec("tyro") is None:
        tyro = types.ModuleType("tyro")
        constructors = types.ModuleType("tyro.constructors")

        class ConstructorRegistry:
            def primitive_rule(self, function: Callable) -> Callable:
                return function

        constructors.ConstructorRegistry = ConstructorRegistry
        constructors.PrimitiveTypeInfo = object
        constructors.PrimitiveConstructorSpec = object
        tyro.constructors = constructors

        def cli(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("tyro is not installed here: the job config is built directly")

        tyro.cli = cli
        sys.modules.update({"tyro": tyro, "tyro.constructors": constructors})
        stood_in.append("tyro")
    if importlib.util.find_spec("torchdata") is None:
        import torch.utils.data

        torchdata = types.ModuleType("torchdata")
        stateful = types.ModuleType("torchdata.stateful_dataloader")
        stateful.StatefulDataLoader = torch.utils.data.DataLoader
        torchdata.stateful_dataloader = stateful
        sys.modules.update({"torchdata": torchdata, "torchdata.stateful_dataloader": stateful})
        stood_in.append("torchdata")
    if importlib.util.find_spec("datasets") is None:
        datasets = types.ModuleType("datasets")
        distributed = types.ModuleType("datasets.distributed")

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("datasets is not installed here: the data are synthetic")

        datasets.Dataset = type("Dataset", (), {})
        datasets.IterableDataset = type("IterableDataset", (), {})
        datasets.load_dataset = unavailable
        distributed.split_dataset_by_node = unavailable
        datasets.distributed = distributed
        sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})
        stood_in.append("datasets")
    return stood_in


def rel_err(got: Any, want: Any) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def bigram_batches(count: int, vocab: int, seq: int, batch: int, seed: int,
                   ignore: bool) -> List[Tuple[Any, Any]]:
    """Synthetic (tokens, labels) [batch, seq]: next token = perm[token] with probability
    0.75; with ``ignore`` a prompt prefix of each row is labelled -100."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    out = []
    for _ in range(count):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        follow = torch.rand(batch, seq, generator=gen) < 0.75
        uniform = torch.randint(0, vocab, (batch, seq), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = torch.where(follow[:, t], perm[tokens[:, t]], uniform[:, t])
        labels = tokens[:, 1:].clone()
        if ignore:
            prompt = torch.randint(1, seq // 4, (batch,), generator=gen)
            labels[torch.arange(seq).unsqueeze(0) < prompt.unsqueeze(1)] = -100
        out.append((tokens[:, :-1].contiguous(), labels))
    return out


# -- part 1: TorchTitan ------------------------------------------------------------------------


def run_torchtitan(src: Path, work: Path) -> Dict[str, Any]:
    import torch

    import cegen
    from cegen import torchtitan as cegen_titan
    from torchtitan.components import loss as titan_loss
    from torchtitan.config.job_config import JobConfig
    from torchtitan.config.manager import ConfigManager
    from torchtitan.protocols import train_spec as titan_spec
    from torchtitan.train import Trainer

    result: Dict[str, Any] = {}
    batches = bigram_batches(2 * STEPS, VOCAB, SEQ, BATCH, seed=11, ignore=True)

    class SyntheticLoader:
        """What the trainer keeps as its data loader (this run feeds train_step itself)."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([({"input": x}, y) for x, y in batches])

        def state_dict(self) -> Dict[str, Any]:
            return {}

        def load_state_dict(self, state: Dict[str, Any]) -> None:
            pass

    def build_synthetic_loader(**kwargs: Any) -> SyntheticLoader:
        return SyntheticLoader()

    base = titan_spec.get_train_spec("llama3")
    args = dataclasses.replace(base.model_args["debugmodel"], vocab_size=VOCAB)
    spec = cegen_titan.cegen_train_spec(dataclasses.replace(
        base, model_args={"debugmodel": args}, build_dataloader_fn=build_synthetic_loader,
        build_tokenizer_fn=None))
    titan_spec.register_train_spec("llama3_cegen", spec)

    config_cls = ConfigManager._merge_configs(JobConfig, cegen_titan.JobConfig)
    job_config = config_cls()
    job_config.model.name = "llama3_cegen"
    job_config.model.flavor = "debugmodel"
    job_config.job.dump_folder = str(work / "titan")
    job_config.training.local_batch_size = BATCH
    job_config.training.global_batch_size = 2 * BATCH  # two microbatches per step
    job_config.training.seq_len = SEQ
    job_config.training.steps = STEPS
    job_config.lr_scheduler.warmup_steps = 2
    job_config.metrics.log_freq = 1
    job_config.debug.seed = 7

    trainer = Trainer(job_config)
    model = trainer.model_parts[0]
    result["trainer_loss_is_cegens"] = hasattr(trainer.loss_fn, "_cegen_fallback")
    result["reduction"] = getattr(trainer.loss_fn, "_cegen_reduction", None)
    result["amp"] = type(trainer.maybe_enable_amp).__name__
    result["parameters"] = sum(p.numel() for p in model.parameters())

    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Before the first step AdamW has no state; the groups hold the scheduled learning rate.
    optimizer_states = [copy.deepcopy(o.state_dict()) for o in trainer.optimizers.optimizers]
    scheduler_states = [copy.deepcopy(s.state_dict()) for s in trainer.lr_schedulers.schedulers]

    records = Records()
    logging.getLogger("cegen.torchtitan").addHandler(records)
    seen: Dict[str, List[int]] = {"logits": [], "grad": [], "dtype": []}

    def on_output(module: Any, inputs: Any, output: Any) -> None:
        seen["logits"].append(output.data_ptr())  # no reference to the logits kept
        seen["dtype"].append(str(output.dtype))
        output.register_hook(lambda grad: seen["grad"].append(grad.data_ptr()))

    model.output.register_forward_hook(on_output)

    def run(name: str, loss_fn: Callable) -> Dict[str, Any]:
        with torch.no_grad():
            model.load_state_dict(initial)
        for optimizer, state in zip(trainer.optimizers.optimizers, optimizer_states):
            optimizer.load_state_dict(state)
        for scheduler, state in zip(trainer.lr_schedulers.schedulers, scheduler_states):
            scheduler.load_state_dict(state)
        trainer.step = 0
        trainer.loss_fn = loss_fn
        losses: List[float] = []
        first_grads: Dict[str, Any] = {}
        original_step = trainer.optimizers.step

        def step_and_record(*args: Any, **kwargs: Any) -> Any:
            if not first_grads:
                for pname, p in model.named_parameters():
                    if p.grad is not None:
                        first_grads[pname] = p.grad.detach().float().clone()
            return original_step(*args, **kwargs)

        trainer.optimizers.step = step_and_record
        forward_backward = trainer.forward_backward_step
        microbatch_losses: List[Any] = []

        def record_loss(**kwargs: Any) -> Any:
            loss = forward_backward(**kwargs)
            microbatch_losses.append(loss.detach())
            return loss

        trainer.forward_backward_step = record_loss
        for key in seen:
            seen[key].clear()
        records.messages.clear()
        cegen.reset_overwrite_warnings()
        iterator = trainer.batch_generator(SyntheticLoader())  # as Trainer.train feeds train_step
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(STEPS):
                    trainer.step += 1
                    trainer.train_step(iterator)
                    losses.append(float(torch.stack(microbatch_losses).sum()))
                    microbatch_losses.clear()
                torch.cuda.synchronize()
        finally:
            del trainer.optimizers.step
            del trainer.forward_backward_step
        return {
            "losses": losses,
            "grads": first_grads,
            "refused": [str(w.message) for w in caught
                        if issubclass(w.category, cegen.OverwriteRefusedWarning)],
            "fallback_logs": list(records.messages),
            "grad_in_logits_storage": bool(seen["grad"]) and seen["grad"] == seen["logits"],
            "logits_dtype": sorted(set(seen["dtype"])),
        }

    titan_fn = titan_loss.build_cross_entropy_loss(job_config)
    runs = {"cegen": run("cegen", trainer.loss_fn), "torchtitan": run("torchtitan", titan_fn)}
    job_config.cegen.overwrite_input = True
    runs["cegen_overwrite"] = run("cegen_overwrite", spec.build_loss_fn(job_config))
    reference = runs["torchtitan"]
    for name in ("cegen", "cegen_overwrite"):
        this = runs[name]
        result[name] = {
            "losses": this["losses"],
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(this["losses"], reference["losses"])),
            "first_step_grad_rel_err_max": max(rel_err(this["grads"][k], reference["grads"][k])
                                               for k in reference["grads"]),
            "first_step_grad_rel_err_output": rel_err(this["grads"]["output.weight"],
                                                      reference["grads"]["output.weight"]),
            "refused": this["refused"],
            "fallback_logs": this["fallback_logs"],
            "grad_in_logits_storage": this["grad_in_logits_storage"],
            "logits_dtype": this["logits_dtype"],
        }
    result["torchtitan"] = {"losses": reference["losses"], "logits_dtype": reference["logits_dtype"]}

    # The DTensor fallback: vocabulary-sharded logits under loss_parallel, as TorchTitan's
    # tensor parallelism hands them to the loss (a mesh of this one GPU).
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.parallel import loss_parallel

        cegen_titan.reset_fallback_log()
        records.messages.clear()
        pred = torch.randn(2, 64, VOCAB, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, VOCAB, (2, 64), device="cuda")
        mesh = init_device_mesh("cuda", (1,))
        sharded = distribute_tensor(pred, mesh, [Shard(2)])
        loss_fn = spec.build_loss_fn(job_config)
        with loss_parallel():
            got = loss_fn(sharded, labels)
            again = loss_fn(sharded, labels)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        expected = titan_fn(pred, labels)
        result["dtensor"] = {"logs": list(records.messages), "loss": float(got),
                             "torchtitan_loss_on_plain_tensor": float(expected),
                             "second_call_equal": float(again.full_tensor() if hasattr(again, "full_tensor") else again) == float(got)}
    except Exception:
        result["dtensor"] = {"error": traceback.format_exc()[-2000:]}
    logging.getLogger("cegen.torchtitan").removeHandler(records)
    return result


# -- part 2: Primus's patch on Megatron-Core ----------------------------------------------------


def run_primus_megatron() -> Dict[str, Any]:
    import torch
    from types import SimpleNamespace

    import cegen
    from cegen import megatron as turbo_ce
    from cegen import primus as cegen_primus
    from megatron.core import parallel_state
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from primus.core.patches import run_patches

    result: Dict[str, Any] = {"primus_registry": sys.modules["primus.core.patches"].__file__}
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, bf16=True,
                               params_dtype=torch.bfloat16, hidden_dropout=0.0,
                               attention_dropout=0.0, cross_entropy_loss_fusion=True)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=MEGATRON_SEQ).cuda()
    model = Float16Module(config, gpt)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = [(x.cuda(), y.cuda()) for x, y in
            bigram_batches(STEPS, VOCAB, MEGATRON_SEQ, BATCH, seed=21, ignore=False)]
    position_ids = torch.arange(MEGATRON_SEQ, device="cuda").unsqueeze(0).expand(BATCH, MEGATRON_SEQ)
    original = LanguageModule.__dict__["compute_language_model_loss"]

    def primus_before_train(use: bool, overwrite: bool) -> int:
        params = SimpleNamespace(use_turbo_cross_entropy=use, turbo_ce_overwrite_input=overwrite,
                                 cross_entropy_loss_fusion=True)
        return run_patches(backend="megatron", phase="before_train",
                           extra={"module_config": SimpleNamespace(params=params),
                                  "backend_args": params})

    def restore() -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(initial[name])

    seen: Dict[str, Any] = {}

    def on_output(module: Any, inputs: Any, output: Any) -> None:
        logits = output[0]
        seen["logits"] = logits.data_ptr()
        logits.register_hook(lambda grad: seen.__setitem__("grad", grad.data_ptr()))

    gpt.output_layer.register_forward_hook(on_output)

    def loss_and_grads(tokens: Any, labels: Any) -> Tuple[Any, Dict[str, Any], List[str]]:
        model.zero_grad(set_to_none=True)
        cegen.reset_overwrite_warnings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(tokens, position_ids, None, labels=labels)
            loss.mean().backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        return loss.detach().float(), grads, [str(w.message) for w in caught
                                              if issubclass(w.category, cegen.OverwriteRefusedWarning)]

    records = Records()
    logging.getLogger("cegen.megatron").addHandler(records)
    tokens, labels = data[0]
    result["applied_off"] = primus_before_train(False, False)
    result["patched_when_off"] = LanguageModule.__dict__["compute_language_model_loss"] is not original
    ref_loss, ref_grads, _ = loss_and_grads(tokens, labels)
    for overwrite in (False, True):
        name = "overwrite" if overwrite else "plain"
        LanguageModule.compute_language_model_loss = original
        applied = primus_before_train(True, overwrite)
        current = LanguageModule.__dict__["compute_language_model_loss"]
        restore()
        loss, grads, refused = loss_and_grads(tokens, labels)
        result[name] = {
            "applied": applied,
            "cegen_in_place": cegen_primus._is_cegen_layer(current),
            "max_abs_loss_diff": float((loss - ref_loss).abs().max()),
            "grad_rel_err_max": max(rel_err(grads[k], ref_grads[k]) for k in ref_grads),
            "refused": refused,
            "grad_in_logits_storage": seen.get("grad") == seen.get("logits"),
            "fallback_logs": list(records.messages),
        }
    curves: Dict[str, List[float]] = {}
    for name, use in (("cegen", True), ("megatron", False)):
        LanguageModule.compute_language_model_loss = original
        primus_before_train(use, use)
        restore()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curves[name] = []
        for tokens, labels in data:
            optimizer.zero_grad(set_to_none=True)
            loss = model(tokens, position_ids, None, labels=labels).mean()
            loss.backward()
            optimizer.step()
            curves[name].append(float(loss.detach()))
    result["training"] = {
        "cegen": curves["cegen"], "megatron": curves["megatron"],
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(curves["cegen"], curves["megatron"])),
    }
    LanguageModule.compute_language_model_loss = original
    turbo_ce.reset_fallback_log()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True,
                        help="the folder prepare_titan_primus_run.sh made")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="torchtitan,primus_megatron",
                        help="comma-separated: torchtitan, primus_megatron")
    args = parser.parse_args()
    src = args.src.resolve()
    sys.path[:0] = [str(REPO / "python"), str(src / "titan"), str(src / "megatron"),
                    str(src / "primus")]
    stood_in = stand_in_missing_modules()

    import torch
    import torch.distributed as dist

    import cegen

    cegen.set_runtime_library(src / "lib" / "libce_runtime.so")
    cegen.configure(bundle_dirs=[src / "bundle-titan", src / "bundle-megatron"])
    # The single-process distributed setup torchrun would give (TorchTitan reads it).
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    work = Path(tempfile.mkdtemp(prefix="cegen-gpu20-"))
    result: Dict[str, Any] = {
        "torch": torch.__version__, "device": torch.cuda.get_device_name(),
        "stood_in_modules": stood_in,
    }
    for name, part in (("torchtitan", lambda: run_torchtitan(src, work)),
                       ("primus_megatron", run_primus_megatron)):
        if name not in args.parts.split(","):
            continue
        try:
            result[name] = part()
        except Exception:
            result[name] = {"error": traceback.format_exc()[-4000:]}
        print(f"== {name} done", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "grads"}
        return value

    text = json.dumps(strip(result), indent=1, default=str)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
