"""Tensor-parallel kernels in the AMD emulator, against float64: ``shard_stats`` and the
sharded backward (a backward kernel called on a vocabulary slice).

docs/tensor-parallel.md's contract, as test/python/test_tensor_parallel.py checks it on the
host, at emulator sizes, through cegen's runtime (``ce_shard_stats``/``ce_backward`` via the
ctypes binding, its HIP backend's argument packing) on run_emulated.py's emulated devices.
Each case is a global vocabulary of ``world * V_local`` ids whose rank ``rank`` slice
(``shard_start = rank * V_local``, ``shard_vocab = world * V_local``) the kernel sees; labels
fall inside the slice, elsewhere in the global vocabulary, or are the ignore_index (-100).

- ``shard_stats``: per token (max, sum exp(x - max) - 1, target logit or 0, row sum with
  smoothing, else 0) against the float64 definition (test_tensor_parallel.reference_stats):
  max and target bitwise, the sum within 1e-5 relative (plus 1e-5), the row sum within
  2^-20 of sum |x| (plus 1e-5 relative); the padding of the stats buffer kept.
- sharded backward: the slice's gradient ``g (exp(x - lse) - (1 - s)[j == y] - s / V_s)``
  with ``lse`` the combined one (cegen.combine_shard_stats on every rank's float64
  statistics rounded to f32, as the trainer's all-reduce hands it), smoothing over the slice
  (``V_s = V_local``, Megatron-Core's) or the whole vocabulary (``shard_global_smoothing``),
  ``s = alpha V_s / (V_s - 1)``; test_h200.grad_tolerance on the float64 reference.
- bad labels (outside ``[0, shard_vocab)``, strict policy): ce_check_label_status answers
  LabelOutOfRangeError naming the global vocabulary, the token's target (shard_stats) or
  gradient row (backward) is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List

IGNORE = -100


@dataclass
class ShardCase:
    name: str
    s: int  # tokens: S x B ([S, B, V] logits; flat: S B rows)
    b: int
    local: int  # V_local
    world: int
    rank: int


CASES = [
    ShardCase("vocab1-slice", 3, 2, 1, 3, 1),
    ShardCase("slice7-of-21", 5, 3, 7, 3, 1),
    ShardCase("slice600-of-1800-first", 4, 2, 600, 3, 0),
    ShardCase("slice1500-of-3000-last", 3, 2, 1500, 2, 1),
    # Longer than one step of a 256-thread workgroup (256 x 8 bf16 = 2048): every wave holds
    # elements, so the last wave's partial sums count in the cross-wave reduction (the shorter
    # slices leave it at 0, and an add of it turned into a subtract went unnoticed).
    ShardCase("slice2500-of-5000-last", 2, 2, 2500, 2, 1),
]
#: ``--set smoke``'s cases.
SMOKE_CASES = ["slice7-of-21", "slice600-of-1800-first", "slice2500-of-5000-last"]


def parse_key(text: str) -> dict:
    return dict(field.split("=", 1) for field in text.split(","))


def wanted_backward(text: str) -> bool:
    """Backward kernels the sharded cases run on (no z-loss: a shard's caller has none in the
    kernel; no overwrite: the slice's gradient is written apart; no softcap: the cases have
    no cap)."""
    key = parse_key(text)
    return (key.get("op") == "backward" and key.get("z_loss") == "off"
            and key.get("overwrite") == "0" and "softcap" not in key)


def run_kernel(harness, report, text: str, cases: List[ShardCase], seed: int, mix: Callable,
               note_worst: Callable[[str, float, str], None]) -> None:
    for case in cases:
        run_case(harness, report, text, case, seed, mix, note_worst)


def reference_stats(torch, x, labels, start: int, vocab: int, smoothing: bool):
    """test_tensor_parallel.reference_stats for token rows x [n, V_local] (float64) and labels
    [n] (strict policy, ignore_index -100), float64 (not rounded)."""
    top = x.max(dim=-1).values
    at_top = x == top.unsqueeze(-1)
    terms = torch.where(at_top, torch.zeros_like(x), torch.exp(x - top.unsqueeze(-1)))
    rest = terms.sum(dim=-1) + (at_top.sum(dim=-1) - 1)
    local = labels - start
    inside = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, torch.where(inside, local, torch.zeros_like(local)).unsqueeze(-1)).squeeze(-1)
    target = torch.where(inside, picked, torch.zeros_like(picked))
    ignored = labels == IGNORE
    bad = ((labels < 0) | (labels >= vocab)) & ~ignored
    target = torch.where(ignored, torch.zeros_like(target), target)
    target = torch.where(bad, torch.full_like(target, math.nan), target)
    total = x.sum(dim=-1) if smoothing else torch.zeros_like(top)
    return torch.stack([top, rest, target, total], dim=-1)


def run_case(harness, report, text: str, case: ShardCase, seed: int, mix: Callable,
             note_worst: Callable[[str, float, str], None]) -> None:
    import torch
    import test_h200 as h200

    import cegen

    key = parse_key(text)
    op, layout = key["op"], key["layout"]
    smoothing = key["label_smoothing"] == "on"
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[key["logits"]]
    label_dtype = torch.int32 if key["labels"] == "i32" else torch.int64
    gen = torch.Generator().manual_seed(mix(seed, f"shard/{text}/{case.name}"))
    S, B, L, W = case.s, case.b, case.local, case.world
    n, G, start = S * B, case.local * case.world, case.rank * case.local
    # Token t's row (token-major in the labels' order) and the logits' layout.
    if layout == "flat":
        shape, tokens = [n, L], [n]
    else:
        shape, tokens = [S, B, L], ([B, S] if layout == "sbv_bs" else [S, B])

    def rows_of(t):  # logits-shaped [.., L] -> token rows [n, L] in the labels' order
        if layout == "sbv_bs":
            return t.transpose(0, 1).reshape(n, -1)
        return t.reshape(n, -1)

    def from_rows(rows):
        if layout == "sbv_bs":
            return rows.reshape(B, S, -1).transpose(0, 1).contiguous()
        return rows.reshape(shape[:-1] + [-1]).contiguous()

    full = (torch.randn([n, G], generator=gen, dtype=torch.float64) * 2.0).to(dtype).double()
    x = full[:, start:start + L]
    # Labels: in the slice, elsewhere in the vocabulary, ignored (every kind once when n allows).
    kind = torch.randint(0, 3, (n,), generator=gen)
    kind[torch.randperm(n, generator=gen)[:min(n, 3)]] = torch.arange(min(n, 3))
    inside = start + torch.randint(0, L, (n,), generator=gen)
    others = [v for v in range(G) if not start <= v < start + L]
    elsewhere = torch.tensor(others)[torch.randint(0, len(others), (n,), generator=gen)] \
        if others else inside
    labels = torch.where(kind == 0, inside, torch.where(kind == 1, elsewhere,
                                                        torch.full_like(inside, IGNORE)))
    alpha = float(torch.rand([], generator=gen)) * 0.3 + 0.05 if smoothing else 0.0
    # Smoothing over a one-id slice is undefined (s = alpha V_s / (V_s - 1)): global only there.
    modes = ((False, True) if L > 1 else (True,)) if op == "backward" and smoothing else (False,)
    for global_smoothing in modes:
        where = f"{case.name}{' global-smoothing' if global_smoothing else ''} alpha {alpha:.4g}"
        options = harness.rt.default_options()
        options.has_ignore_index, options.ignore_index = 1, IGNORE
        options.label_smoothing = alpha
        options.label_layout = 1 if layout == "sbv_sb" else 0
        options.shard_start, options.shard_vocab = start, G
        options.shard_global_smoothing = 1 if global_smoothing else 0
        logits = from_rows(x).to(dtype)
        label_t = labels.view(tokens if layout != "sbv_bs" else [B, S]).to(label_dtype).contiguous()
        if op == "shard_stats":
            check_stats(torch, harness, report, text, where, options, logits, label_t, x, labels,
                        start, G, smoothing, tokens, note_worst)
        else:
            check_backward(torch, h200, cegen, harness, report, text, where, options, logits,
                           label_t, full, labels, case, smoothing, alpha, global_smoothing,
                           rows_of, from_rows, tokens, note_worst, gen)
    # A bad label (outside [0, G)), strict policy: the status, and NaN for that token.
    if n:
        bad_label = G + 3 if seed % 2 else -7
        bad = labels.clone()
        bad[n // 2] = bad_label
        check_bad_label(torch, harness, report, text, case, key, bad, bad_label, n // 2, full,
                        start, G, layout, tokens, from_rows, rows_of, dtype, label_dtype, B, S)


def call(harness, fn, *args):
    try:
        fn(*args, None)
        harness.check_labels(wait=True)
        return None
    except Exception as caught:  # noqa: BLE001 - a failed launch is a failure of its own
        return caught


def check_stats(torch, harness, report, text, where, options, logits, label_t, x, labels, start,
                G, smoothing, tokens, note_worst):
    # The stats in a padded buffer: [*tokens, 4] at stride 5 (the fifth float must survive).
    storage = torch.full(tokens + [5], 3.5, dtype=torch.float32)
    stats = storage[..., :4]
    error = call(harness, harness.rt.shard_stats, harness.kernels[text], options,
                 harness.desc(logits, parse_key(text)["logits"]),
                 harness.desc(label_t, parse_key(text)["labels"]), harness.desc(stats, "f32"))
    report.check(error is None, text, where, lambda: f"ce_shard_stats: {error}")
    if error is not None:
        return
    report.check(bool((storage[..., 4] == 3.5).all()), text, where,
                 lambda: "the stats buffer's padding was written")
    if not labels.numel():
        return
    ref = reference_stats(torch, x, labels, start, G, smoothing)
    got = stats.reshape(-1, 4).double()
    exact = torch.stack([got[:, 0] == ref[:, 0],
                         (got[:, 2] == ref[:, 2]) | (torch.isnan(got[:, 2]) & torch.isnan(ref[:, 2]))],
                        dim=1)
    tol_rest = 1e-5 + 1e-5 * ref[:, 1].abs()
    tol_sum = 1e-5 + 1e-5 * ref[:, 3].abs() + 2.0 ** -20 * x.abs().sum(dim=-1)
    err_rest, err_sum = (got[:, 1] - ref[:, 1]).abs(), (got[:, 3] - ref[:, 3]).abs()
    ok = torch.cat([exact, (err_rest <= tol_rest).unsqueeze(1), (err_sum <= tol_sum).unsqueeze(1)], 1)
    note_worst(f"shard_stats {parse_key(text)['logits']} sum (err / tolerance)",
               float((err_rest / tol_rest).max()), f"{text} {where}")
    if smoothing:
        note_worst(f"shard_stats {parse_key(text)['logits']} row sum (err / tolerance)",
                   float((err_sum / tol_sum).max()), f"{text} {where}")
    names = ["max", "target", "sum exp - 1", "row sum"]
    order = [0, 2, 1, 3]
    report_bad(report, text, where, ok, lambda t, field: (
        f"token {t} label {int(labels[t])} {names[field]}: got {got[t, order[field]]:.9g} "
        f"ref {ref[t, order[field]]:.9g}"))


def report_bad(report, text, where, ok, describe) -> None:
    """Counts the passing entries of the 2-D mask ``ok`` as checks and reports each failing
    one (t, k) as a failed check, the first 20 described by ``describe(t, k)``."""
    bad = (~ok).nonzero().tolist()
    report.checks += ok.numel() - len(bad)
    for t, k in bad[:20]:
        report.check(False, text, where, lambda t=t, k=k: describe(t, k))
    for _ in bad[20:]:
        report.check(False, text, where, lambda: "(more)")


def combined_lse(torch, cegen, full, labels, case, alpha, global_smoothing):
    """Every rank's float64 statistics rounded to f32, combined as the trainer does:
    (lse, lse_low), the latter lse's low part (bundle format 4)."""
    L, W = case.local, case.world
    G = L * W
    stats = torch.stack([reference_stats(torch, full[:, r * L:(r + 1) * L], labels, r * L, G,
                                         alpha > 0).float() for r in range(W)])
    _loss, lse, low = cegen.combine_shard_stats(
        stats, labels, ignore_index=IGNORE, label_smoothing=alpha, z_loss=0.0, vocab_local=L,
        vocab=G, global_smoothing=global_smoothing, rank=case.rank, with_low=True)
    return lse.float(), low.float()


def check_backward(torch, h200, cegen, harness, report, text, where, options, logits, label_t,
                   full, labels, case, smoothing, alpha, global_smoothing, rows_of, from_rows,
                   tokens, note_worst, gen):
    key = parse_key(text)
    n, L, start = labels.numel(), case.local, case.rank * case.local
    G = L * case.world
    lse, low = combined_lse(torch, cegen, full, labels, case, alpha, global_smoothing) if n else \
        (torch.zeros([0]), torch.zeros([0]))
    # Every other call passes lse's low part (ce_options.lse_low, flag bit 3), as the trainer
    # does; the reference then takes lse + lse_low.
    with_low = bool(torch.rand([], generator=gen) < 0.5)
    g = torch.rand([n], generator=gen, dtype=torch.float64) * 1.5 + 0.25
    g = torch.where(torch.rand([n], generator=gen) < 0.15, torch.zeros_like(g), g).float()
    lse_t = lse.reshape(tokens).contiguous()
    low_t = low.reshape(tokens).contiguous()
    if with_low:
        import ctypes

        low_desc = harness.desc(low_t, "f32")  # kept alive through the call
        options = type(options).from_buffer_copy(options)
        options.lse_low = ctypes.addressof(low_desc)
    g_t = g.reshape(tokens).contiguous()
    storage = torch.full([n * (L + 2) + 4], 5.5, dtype=logits.dtype)
    grad = storage[:n * (L + 2)].view(n, L + 2)[:, :L]  # token rows, padded
    # The gradient in the logits' layout over the padded rows.
    if key["layout"] == "flat":
        out = grad
    else:  # [S, B, L] rows in memory order (s, b)
        out = storage[:n * (L + 2)].as_strided([case.s, case.b, L], [case.b * (L + 2), L + 2, 1])
    error = call(harness, harness.rt.backward, harness.kernels[text], options,
                 harness.desc(logits, key["logits"]), harness.desc(label_t, key["labels"]),
                 harness.desc(lse_t, "f32"), harness.desc(g_t, "f32"), harness.desc(out, key["logits"]))
    report.check(error is None, text, where, lambda: f"ce_backward (shard): {error}")
    if error is not None or n == 0:
        return
    pad = storage[:n * (L + 2)].view(n, L + 2)[:, L:]
    report.check(bool((pad.double() == 5.5).all()) and float(storage[-1]) == 5.5, text, where,
                 lambda: "the gradient's padding was written")
    got = rows_of(out).double()
    x = full[:, start:start + L]
    lse64 = (lse.double() + (low.double() if with_low else 0.0)).unsqueeze(1)
    p = torch.exp(x - lse64)
    vs = G if global_smoothing else L
    s = alpha * vs / (vs - 1) if alpha else 0.0
    local = labels - start
    onehot = torch.zeros_like(x)
    in_slice = (local >= 0) & (local < L)
    onehot[in_slice.nonzero().flatten(), local[in_slice]] = 1.0
    gg = g.double().unsqueeze(1)
    ref = gg * (p - (1 - s) * onehot - s / vs)
    ref = torch.where((labels == IGNORE).unsqueeze(1), torch.zeros_like(ref), ref)
    term = (gg * (p + (1 - s) * onehot + s / vs)).abs()
    tolerance = h200.grad_tolerance(key["logits"], ref, term)
    err = (got - ref).abs()
    ok = err <= tolerance
    ratio = torch.where(err == 0, torch.zeros_like(err), err / tolerance)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    note_worst(f"sharded grad {key['logits']} (err / tolerance)", float(ratio.max()),
               f"{text} {where}")
    report_bad(report, text, where, ok, lambda t, j: (
        f"token {t} label {int(labels[t])} [{j}] (global {start + j}): got {got[t, j]:.9g} "
        f"ref {ref[t, j]:.9g} (g {float(g[t]):.6g}, lse {float(lse[t]):.9g})"))


def check_bad_label(torch, harness, report, text, case, key, labels, bad_label, bad_token, full,
                    start, G, layout, tokens, from_rows, rows_of, dtype, label_dtype, B, S):
    import cegen

    where = f"{case.name} bad-label {bad_label}"
    n, L = labels.numel(), case.local
    x = full[:, start:start + L]
    logits = from_rows(x).to(dtype)
    label_t = labels.view(tokens).to(label_dtype).contiguous()
    options = harness.rt.default_options()
    options.has_ignore_index, options.ignore_index = 1, IGNORE
    options.label_layout = 1 if layout == "sbv_sb" else 0
    options.shard_start, options.shard_vocab = start, G
    if key["label_smoothing"] == "on":
        options.label_smoothing = 0.1
    if key["op"] == "shard_stats":
        out = torch.zeros(tokens + [4], dtype=torch.float32)
        error = call(harness, harness.rt.shard_stats, harness.kernels[text], options,
                     harness.desc(logits, key["logits"]), harness.desc(label_t, key["labels"]),
                     harness.desc(out, "f32"))
    else:
        lse = torch.logsumexp(full, dim=-1).float().reshape(tokens).contiguous()
        g = torch.ones(tokens, dtype=torch.float32)
        out = torch.zeros_like(logits)
        error = call(harness, harness.rt.backward, harness.kernels[text], options,
                     harness.desc(logits, key["logits"]), harness.desc(label_t, key["labels"]),
                     harness.desc(lse, "f32"), harness.desc(g, "f32"), harness.desc(out, key["logits"]))
    is_label = isinstance(error, cegen.LabelOutOfRangeError)
    report.check(is_label, text, where, lambda: f"expected LabelOutOfRangeError, got {error!r}")
    if not is_label:
        return
    report.check(f"is not in [0, {G})" in str(error), text, where,
                 lambda: f"message {error} does not name [0, {G})")
    if key["op"] == "shard_stats":
        value = float(out.reshape(n, 4)[bad_token, 2])
        report.check(math.isnan(value), text, where, lambda: f"target of the bad label {value}")
    else:
        row = rows_of(out).double()[bad_token]
        report.check(bool(torch.isnan(row).all()), text, where,
                     lambda: f"gradient row of the bad label not NaN: {row[:4].tolist()}")
