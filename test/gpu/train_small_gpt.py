#!/usr/bin/env python3
"""A short training run of a small GPT with cegen's loss and with PyTorch's, same seed.

Not a CI test (it needs a CUDA GPU); run on the H200 and recorded in docs/GPU-TESTS.md.

The model is a decoder-only transformer in Megatron's layout: hidden states and logits
``[S, B, *]``, labels ``[B, S]``, per-token fp32 loss ``[B, S]`` averaged by the caller. Data
are synthetic sequences from a fixed random bigram rule (token t+1 = perm[token t] with
probability 0.75, else uniform), so the loss has something to learn. Three runs from the same
initial weights and batches:

- ``torch``: ``F.cross_entropy(logits.float(), ...)`` (what Megatron's unfused path computes);
- ``cegen``: ``cegen.cross_entropy`` on the bf16 logits, gradient into a fresh buffer;
- ``cegen_overwrite``: the same with ``overwrite_input=True`` (gradient written over the logits).

It prints and writes (``--out``) per-step losses, their largest difference, step times and peak
memory per run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

import cegen  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class SmallGPT(nn.Module):
    """Embeddings, pre-norm blocks, an output layer: logits [S, B, V]."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, 1, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, tokens_sb: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_sb) + self.pos
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.norm(x))


def make_batches(steps: int, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    tokens = torch.empty(steps, batch, seq + 1, dtype=torch.long)
    tokens[:, :, 0] = torch.randint(0, vocab, (steps, batch), generator=gen)
    for t in range(seq):
        follow = torch.rand(steps, batch, generator=gen) < 0.75
        uniform = torch.randint(0, vocab, (steps, batch), generator=gen)
        tokens[:, :, t + 1] = torch.where(follow, perm[tokens[:, :, t]], uniform)
    return tokens


def run(kind: str, args: argparse.Namespace, batches: torch.Tensor) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    model = SmallGPT(args.vocab, args.width, args.layers, args.heads, args.seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times = [], []
    refused = []
    torch.cuda.synchronize()
    for step in range(args.steps):
        if step == 5:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tokens = batches[step].to(device, non_blocking=True)   # [B, S+1]
        inputs_sb = tokens[:, :-1].t()                         # [S, B]
        labels_bs = tokens[:, 1:]                              # [B, S], a strided view
        start = time.perf_counter()
        if kind == "torch":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inputs_sb)                      # [S, B, V] bf16
            per_token = F.cross_entropy(
                logits.float().reshape(-1, args.vocab), labels_bs.t().reshape(-1),
                reduction="none").view(args.seq, args.batch).t()
            del logits
        else:
            # The logits go straight into the loss, as in Megatron's loss
            # function: no other reference is kept, so overwrite-input may
            # reuse their storage for the gradient.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    per_token = cegen.cross_entropy(
                        model(inputs_sb), labels_bs, label_layout="bs",
                        overwrite_input=(kind == "cegen_overwrite"))
            refused.extend(str(w.message) for w in caught)
        loss = per_token.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "kind": kind,
        "losses": losses,
        "median_step_ms": 1e3 * sorted(times[5:])[len(times[5:]) // 2],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "warnings": sorted(set(refused)),
        "finite": all(math.isfinite(x) for x in losses),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", type=Path, required=True)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    cegen.set_runtime_library(args.runtime)
    cegen.configure(bundle_dirs=[args.bundle])
    batches = make_batches(args.steps, args.batch, args.seq, args.vocab, args.seed)
    results = [run(kind, args, batches) for kind in ("torch", "cegen", "cegen_overwrite")]
    base = results[0]["losses"]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.steps} steps, V={args.vocab}, S={args.seq}, B={args.batch}, "
          f"width {args.width}, {args.layers} layers")
    print(f"{'run':16} {'first':>8} {'step 100':>9} {'last':>8} {'max |diff| vs torch':>20} "
          f"{'ms/step':>8} {'peak GiB':>9} finite")
    for r in results:
        diff = max(abs(a - b) for a, b in zip(r["losses"], base))
        r["max_abs_diff_vs_torch"] = diff
        mid = r["losses"][min(100, len(base) - 1)]
        print(f"{r['kind']:16} {r['losses'][0]:8.4f} {mid:9.4f} {r['losses'][-1]:8.4f} "
              f"{diff:20.2e} {r['median_step_ms']:8.2f} {r['peak_gib']:9.3f} {r['finite']}")
        for w in r["warnings"]:
            print(f"  warning ({r['kind']}): {w}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_small_gpt.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    ok = all(r["finite"] for r in results)
    print("OK" if ok else "FAILED: non-finite loss")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
