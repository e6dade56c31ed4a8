"""One rank of the tensor-parallel group test_primus.py starts (not a unittest module).

Usage (the test runs it; by hand only to debug)::

    python3 _primus_tp_worker.py --rank R --world W --port P --inputs IN.pt \
        --output OUT.pt --cache-dir DIR

It joins a gloo group through the TCP store the test holds on 127.0.0.1:P and, for each run
of ``IN.pt`` (an experiment YAML and Primus command-line overrides), puts LanguageModule's
method back, runs the Primus stand-in's ``before_train`` patches (cegen.primus registered),
then a forward and backward of the Megatron stand-in's TinyGPTModel holding this rank's
rows of the output weight, at TP = W over the group; it saves each run's loss, weight
gradient slice, fallback calls, cegen.megatron warnings and overwrite refusals.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent / "python"), str(HERE / "primus_standin"),
                str(HERE / "megatron_standin")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cegen  # noqa: E402
from cegen import primus as cegen_primus  # noqa: E402, F401  (registers the patches)
from megatron.core.models.common.language_module import language_module  # noqa: E402
from megatron.core.models.gpt.gpt_model import TinyGPTModel  # noqa: E402
from megatron.core.process_groups_config import FakeProcessGroup, ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from primus.core.runtime import train_runtime  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=120)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run(spec: Dict[str, Any], config_path: Path, cli: List[str], rank: int, world: int,
        group: Any, records: Records) -> Dict[str, Any]:
    original = language_module.LanguageModule.__dict__["compute_language_model_loss"]
    module_config = train_runtime.load_module_config(str(config_path), "pre_trainer")
    train_runtime.apply_overrides(module_config, cli)
    train_runtime.run_before_train(module_config)
    params = module_config.params
    config = TransformerConfig(tensor_model_parallel_size=params.tensor_model_parallel_size,
                               cross_entropy_loss_fusion=params.cross_entropy_loss_fusion)
    groups = ProcessGroupCollection(tp=group, cp=FakeProcessGroup(1), pp=FakeProcessGroup(1),
                                    embd=None)
    weight, hidden = spec["weight"], spec["hidden"]
    rows = weight.shape[0] // world
    module = TinyGPTModel(config, hidden_size=hidden.shape[-1], vocab_size=weight.shape[0],
                          pg_collection=groups,
                          output_weight=weight[rank * rows:(rank + 1) * rows].clone())
    language_module.CALLS["compute_language_model_loss"] = 0
    records.messages.clear()
    cegen.reset_overwrite_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = module(hidden, spec["labels"])
        ((loss * spec["mask"]).sum() / spec["mask"].sum()).backward()
    patched = language_module.LanguageModule.__dict__["compute_language_model_loss"] is not original
    language_module.LanguageModule.compute_language_model_loss = original
    return {
        "patched": patched,
        "loss": loss.detach(),
        "grad": module.output_weight.grad,
        "original_calls": language_module.CALLS["compute_language_model_loss"],
        "logged": list(records.messages),
        "refused": [str(w.message) for w in caught
                    if issubclass(w.category, cegen.OverwriteRefusedWarning)],
    }


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
    group = dist.new_group(list(range(args.world)))  # a group of its own, as Megatron makes
    records = Records()
    logging.getLogger("cegen.megatron").addHandler(records)
    inputs = torch.load(args.inputs)
    results = {name: run(inputs["spec"], Path(path), cli, args.rank, args.world, group, records)
               for name, (path, cli) in inputs["runs"].items()}
    dist.barrier()
    torch.save(results, args.output)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
