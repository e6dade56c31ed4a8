#!/usr/bin/env python3
"""cegen's Megatron patch at tensor-parallel size 2 in a real Megatron-Core GPTModel, two GPUs.

Not a CI test (CI runs the patch against the stand-in at TP = 2 over gloo). On a machine with
two CUDA GPUs, from the repository root, with what test/gpu/prepare_tp_run.sh makes under
.dev/tp and Megatron-Core's source in .dev/megatron (never committed)::

    python3 test/gpu/megatron_tp_h200.py --runtime .dev/tp/lib/libce_runtime.so \\
        --bundles .dev/tp/bundles/shards .dev/tp/bundles/whole --megatron .dev/megatron --out $OUT

Two processes, one NCCL group, ``initialize_model_parallel(2, 1)``; a small GPTModel (2 layers,
hidden 256, 4 heads, bf16 through Float16Module, local layer spec, ``cross_entropy_loss_fusion``,
vocab 32000: 16000 output columns per rank), sequence 256, micro-batch 4, the same synthetic
tokens on both ranks. For overwrite-input off and on, the whole forward/backward with labels, with
Megatron's own loss and then with the patch (``--use-turbo-cross-entropy`` through
``add_turbo_ce_args``): the per-token loss [b, s] within 1e-3, every parameter's gradient within a
small relative error, no fallback logged, and with overwrite-input the gradient reaching the
output layer lives in the logits' own storage. Then with ``--turbo-ce-fuse-output-layer`` too
(the output layer and the loss together, ``cegen.linear_cross_entropy`` over the rank's weight
slice): the same loss and gradients, and the output layer's own forward never runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent.parent
VOCAB, SEQ, BATCH = 32000, 256, 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run(rank: int, world: int, args: argparse.Namespace, out: Dict[str, Any]) -> None:
    import torch
    import cegen
    from cegen import megatron as turbo_ce
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(world, 1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4,
                               tensor_model_parallel_size=world, bf16=True,
                               params_dtype=torch.bfloat16, hidden_dropout=0.0,
                               attention_dropout=0.0, cross_entropy_loss_fusion=True)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    model = Float16Module(config, gpt)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator(device="cuda").manual_seed(4321)  # the same tokens on both ranks
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen, device="cuda")
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)

    def loss_and_grads() -> Any:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(initial[name])
        model.zero_grad(set_to_none=True)
        seen: Dict[str, Any] = {}

        def forward_hook(module: Any, inputs: Any, output: Any) -> None:
            logits = output[0]
            seen["logits_ptr"] = logits.data_ptr()
            seen["logits_shape"] = tuple(logits.shape)
            logits.register_hook(lambda grad: seen.__setitem__("grad_ptr", grad.data_ptr()))

        handle = gpt.output_layer.register_forward_hook(forward_hook)
        try:
            loss = model(input_ids, position_ids, None, labels=labels)
            (loss.sum() / loss.numel()).backward()
        finally:
            handle.remove()
        torch.cuda.synchronize()
        cegen.check_labels()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        return loss.detach().float().clone(), grads, seen

    records = _Records()
    logging.getLogger("cegen.megatron").addHandler(records)
    turbo_ce.uninstall()
    want_loss, want_grads, want_seen = loss_and_grads()
    out["logits_shape_per_rank"] = want_seen["logits_shape"]
    out["cases"] = []
    # The loss patch without and with overwrite-input, then the fused output layer (issue 21,
    # run 4: the output layer's GEMM and the loss together, the output layer's own forward
    # never run).
    for overwrite, fuse in ((False, False), (True, False), (False, True)):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--cross-entropy-loss-fusion", action="store_true")
        argv = ["--cross-entropy-loss-fusion", "--use-turbo-cross-entropy"]
        argv += ["--turbo-ce-overwrite-input"] if overwrite else []
        argv += ["--turbo-ce-fuse-output-layer"] if fuse else []
        parsed = turbo_ce.add_turbo_ce_args(parser, argv=argv).parse_args(argv)
        installed = turbo_ce.install(parsed)
        try:
            got_loss, got_grads, seen = loss_and_grads()
        finally:
            turbo_ce.uninstall()
        rel = {}
        for name, want in want_grads.items():
            got = got_grads[name].double()
            rel[name] = float((got - want.double()).norm() / want.double().norm().clamp_min(1e-30))
        loss_diff = float((got_loss - want_loss).abs().max())
        worst = max(rel, key=rel.get)
        in_place = seen.get("grad_ptr") == seen.get("logits_ptr")
        layout_ok = "logits_ptr" not in seen if fuse else in_place == overwrite
        ok = installed and loss_diff < 1e-3 and rel[worst] < 2e-2 and layout_ok
        out["cases"].append({"overwrite": overwrite, "fuse_output_layer": fuse,
                             "output_layer_forward_ran": "logits_ptr" in seen,
                             "installed": installed,
                             "loss_max_diff": loss_diff, "worst_grad": worst,
                             "worst_grad_rel": rel[worst],
                             "output_layer_grad_rel": rel.get("module.output_layer.weight"),
                             "grad_in_logits_storage": in_place, "ok": ok})
    fallbacks = [m for m in records.messages if "falls back" in m]
    out["fallback_messages"] = fallbacks
    out["ok"] = all(c["ok"] for c in out["cases"]) and not fallbacks


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(REPO / "python"))
    sys.path.insert(0, str(Path(args.megatron).resolve()))
    import cegen
    cegen.configure(runtime_library=str(Path(args.runtime).resolve()),
                    bundle_dirs=tuple(str(Path(b).resolve()) for b in args.bundles),
                    run_ce_gen=False)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result: Dict[str, Any] = {"rank": rank}
    try:
        run(rank, world, args, result)
    except Exception:  # noqa: BLE001 - reported by the parent
        result["error"] = traceback.format_exc()[-4000:]
        result["ok"] = False
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"megatron_tp_rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--bundles", nargs="+", required=True)
    parser.add_argument("--megatron", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2, help="1: a check of the script itself")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp
    world = args.world
    if torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}")
        return 2
    mp.spawn(worker, args=(world, _free_port(), args), nprocs=world, join=True)
    failed = 0
    for rank in range(world):
        result = json.loads((Path(args.out) / f"megatron_tp_rank{rank}.json").read_text())
        print(json.dumps(result, indent=1))
        failed += not result.get("ok", False)
    print("PASS" if failed == 0 else f"FAIL ({failed} rank(s))")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
