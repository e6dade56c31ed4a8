"""The fused gradient's correction (``ce_rescale``, op=rescale) in the AMD emulator, against float64.

test/runtime/RescaleTest.cpp's contract and cases (ce_runtime.h, the dialect's ``ce.rescale``),
at emulator sizes, run through cegen's runtime (``ce_rescale`` via the ctypes binding, its HIP
backend's argument packing) on run_emulated.py's emulated HIP devices. Per token the pair
``(g, w) = (grad_loss[t], weights[t])`` is one of:

- equal (also both +0): the row must be bitwise unchanged;
- ``-0`` against ``+0`` (``g == w``): bitwise unchanged; a kernel that rescaled it anyway
  (no early exit) would write zeros of the other sign's product, so this pair sees the skip;
- different: each element ``x * g / w`` within one ulp of the dtype, plus 4 f32 ulps and the
  f32 ratio's own rounding, of the float64 product;
- ``g == 0``, ``w != 0``: the row becomes 0;
- ``w == 0``, ``g != 0`` (on the zero row ce_fused wrote): NaN;
- NaN ``g``: NaN.

Gradients are padded row views in a guarded buffer (the padding must survive), ``grad_loss``
strided (every other element) or stride 0, weights per token, 0-d or stride 0; ``grad_loss`` and
``weights`` must be unchanged. Every case runs on every layout (``flat``: ``[N, V]`` with
``N = S B`` tokens; ``sbv_bs``/``sbv_sb``: ``[S, B, V]`` with ``[B, S]``/``[S, B]`` tokens), one
token per workgroup (the manifest's ``rows_per_block`` 1), skipped and rescaled rows mixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List

EQUAL, DIFFER, MASKED_G, ZERO_WEIGHT, NAN_G, SIGNED_ZEROS, BOTH_ZERO = range(7)
KIND_NAMES = ["g == w", "g != w", "g == 0", "w == 0, g != 0", "NaN g", "g = +0, w = -0",
              "g = w = +0"]
#: Pairs whose row must be bitwise unchanged.
UNTOUCHED = (EQUAL, SIGNED_ZEROS, BOTH_ZERO)


@dataclass
class RescaleCase:
    name: str
    s: int  # tokens: S x B ([S, B, V] gradients; flat: S B rows)
    b: int
    vocab: int
    row_pad: int = 0  # elements between rows
    weights: str = "token"  # token | scalar (0-d) | stride0
    broadcast_g: bool = False  # grad_loss of stride 0


CASES = [
    RescaleCase("empty", 0, 3, 7),
    RescaleCase("vocab1", 5, 1, 1),
    RescaleCase("odd-vocab7", 3, 3, 7, row_pad=3),
    RescaleCase("vectors-vocab64", 4, 3, 64),
    RescaleCase("long-rows-vocab4099", 13, 1, 4099, row_pad=5),
    RescaleCase("scalar-weight-vocab1000", 11, 1, 1000, weights="scalar"),
    RescaleCase("stride0-weight-vocab130", 4, 2, 130, weights="stride0"),
    RescaleCase("broadcast-g-vocab333", 5, 2, 333, broadcast_g=True),
    RescaleCase("3d-vocab517", 3, 4, 517, row_pad=2),
    RescaleCase("many-rows-vocab33", 10, 7, 33, row_pad=1),
]

#: ``--set smoke``'s cases: every pair kind, padding, both g views, 0-d weights, long rows.
SMOKE_CASES = ["empty", "odd-vocab7", "long-rows-vocab4099", "scalar-weight-vocab1000",
               "broadcast-g-vocab333", "many-rows-vocab33"]


def ulp(torch, dtype, values):
    """One unit in the last place of ``dtype`` at ``values`` (float64), as bench/rescale_bench.py."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    tiny = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}
    exponent = torch.floor(torch.log2(values.abs().clamp_min(1e-300)))
    return torch.maximum(torch.pow(2.0, exponent - mantissa),
                         torch.tensor(tiny[dtype], dtype=torch.float64))


def parse_key(text: str) -> dict:
    return dict(field.split("=", 1) for field in text.split(","))


def run_kernel(harness, report, text: str, cases: List[RescaleCase], seed: int, mix: Callable,
               note_worst: Callable[[str, float, str], None]) -> None:
    """Every case on the rescale kernel ``text`` (a key of ``harness.kernels``)."""
    for case in cases:
        run_case(harness, report, text, case, seed, mix, note_worst)


def draw_pairs(torch, case: RescaleCase, n: int, gen):
    """(kinds, g, w) per token, float64 values that are f32s."""
    def positive(count):
        return (torch.rand(count, generator=gen, dtype=torch.float64) * 1.75 + 0.25)

    if case.weights != "token":
        choices = [EQUAL, DIFFER, MASKED_G, NAN_G]  # one w for every token
    elif case.broadcast_g:
        choices = [EQUAL, DIFFER, ZERO_WEIGHT]  # one g for every token
    else:
        choices = [EQUAL, DIFFER, MASKED_G, ZERO_WEIGHT, NAN_G, SIGNED_ZEROS, BOTH_ZERO]
    picks = torch.randint(0, len(choices), (n,), generator=gen)
    kinds = torch.tensor([choices[i] for i in picks.tolist()], dtype=torch.int64)
    # Every kind the case allows occurs (in a random order) when there are tokens enough.
    first = min(n, len(choices))
    kinds[torch.randperm(n, generator=gen)[:first]] = torch.tensor(choices[:first], dtype=torch.int64)
    g, w = positive(n), positive(n)
    if case.weights != "token":
        w[:] = w[0]
    if case.broadcast_g:
        g[:] = g[0]
    same = (kinds == DIFFER) & (g.float() == w.float())
    if case.broadcast_g:  # the pair is chosen by the weight
        w = torch.where(kinds == EQUAL, g, torch.where(same, w * 1.5, w))
    else:
        g = torch.where(kinds == EQUAL, w, torch.where(same, g * 1.5, g))
    g = torch.where(kinds == MASKED_G, 0.0, g)
    w = torch.where(kinds == ZERO_WEIGHT, 0.0, w)
    g = torch.where(kinds == NAN_G, math.nan, g)
    g = torch.where((kinds == SIGNED_ZEROS) | (kinds == BOTH_ZERO), 0.0, g)
    w = torch.where(kinds == SIGNED_ZEROS, -0.0, w)
    w = torch.where(kinds == BOTH_ZERO, 0.0, w)
    return kinds, g.float().double(), w.float().double()


def run_case(harness, report, text: str, case: RescaleCase, seed: int, mix: Callable,
             note_worst: Callable[[str, float, str], None]) -> None:
    import torch

    key = parse_key(text)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[key["logits"]]
    layout = key["layout"]
    gen = torch.Generator().manual_seed(mix(seed, f"rescale/{text}/{case.name}"))
    S, B, V = case.s, case.b, case.vocab
    n = S * B
    # Rows and tokens: row r of the gradient belongs to token token_of_row[r] (row-major index
    # into the token tensor).
    if layout == "flat":
        grad_shape, tokens = [n, V], [n]
        token_of_row = torch.arange(n)
    else:
        grad_shape = [S, B, V]
        tokens = [B, S] if layout == "sbv_bs" else [S, B]
        s_of_row, b_of_row = torch.arange(n) // max(B, 1), torch.arange(n) % max(B, 1)
        token_of_row = b_of_row * S + s_of_row if layout == "sbv_bs" else torch.arange(n)
    kinds, g, w = draw_pairs(torch, case, n, gen)
    # The gradient: a padded row view in a buffer whose other elements hold a fill to keep.
    row_stride = V + case.row_pad
    storage = torch.full([n * row_stride + 8], 7.25, dtype=dtype)
    strides = [row_stride, 1] if layout == "flat" else [B * row_stride, row_stride, 1]
    grad = storage.as_strided(grad_shape, strides, 4)
    x = torch.randn([n, V], generator=gen, dtype=torch.float64) * 1.5
    x = torch.where((kinds == ZERO_WEIGHT)[token_of_row].unsqueeze(1), 0.0, x)
    grad.copy_(x.view(grad_shape).to(dtype))
    in_view = torch.zeros(storage.shape, dtype=torch.bool)
    in_view.as_strided(grad_shape, strides, 4).fill_(True)
    before_storage = storage.clone()
    x_rows = grad.reshape(n, V).double()
    # grad_loss: every other element of a buffer, or one element at stride 0.
    if case.broadcast_g:
        g_tensor = g[:1].float().expand(tokens)
    else:
        g_tensor = torch.zeros(tokens + [2], dtype=torch.float32)[..., 0]
        g_tensor.copy_(g.float().view(tokens))
    if case.weights == "scalar":
        w_tensor = w[:1].float().view([])
    elif case.weights == "stride0":
        w_tensor = w[:1].float().expand(tokens)
    else:
        w_tensor = w.float().view(tokens).clone()
    def bits(tensor):
        return tensor.contiguous().reshape(-1).view(torch.int32).clone()

    g_before, w_before = bits(g_tensor), bits(w_tensor)

    where = f"{case.name}"
    options = harness.rt.default_options()
    options.label_layout = 1 if layout == "sbv_sb" else 0
    bundle = harness.kernels[text]
    error = None
    try:
        harness.rt.rescale(bundle, options, harness.desc(grad, key["logits"]),
                           harness.desc(w_tensor, "f32"), harness.desc(g_tensor, "f32"), None)
    except Exception as caught:  # a refused or failed launch is a failure of its own
        error = caught
    report.check(error is None, text, where, lambda: f"ce_rescale: {error}")
    if error is not None:
        return
    int_type = torch.int32 if dtype == torch.float32 else torch.int16
    report.check(bool(torch.equal(storage.view(int_type)[~in_view],
                                  before_storage.view(int_type)[~in_view])),
                 text, where, lambda: "the gradient's padding was written")
    report.check(bool(torch.equal(bits(g_tensor), g_before) and torch.equal(bits(w_tensor), w_before)),
                 text, where, lambda: "grad_loss or weights changed")
    if n == 0:
        return

    got = grad.reshape(n, V).double()
    bits_after = grad.reshape(n, V).contiguous().view(int_type)
    bits_before = before_storage.as_strided([n, V], [row_stride, 1], 4).contiguous().view(int_type)
    pair = kinds[token_of_row]
    gt, wt = g[token_of_row].unsqueeze(1), w[token_of_row].unsqueeze(1)
    ratio32 = torch.where(gt == 0, 0.0, (gt.float() / wt.float()).double())
    ref = torch.where(gt == 0, x_rows * 0.0, x_rows * (gt / wt))
    tolerance = ulp(torch, dtype, ref) + 4 * ulp(torch, torch.float32, ref) + \
        (x_rows * (ratio32 - torch.where(gt == 0, 0.0, gt / wt))).abs()
    untouched = sum(pair == k for k in UNTOUCHED).bool()
    nan_rows = (pair == ZERO_WEIGHT) | (pair == NAN_G)
    scaled = ~(untouched | nan_rows)
    ok = torch.where(untouched.unsqueeze(1), bits_after == bits_before,
                     torch.where(nan_rows.unsqueeze(1), torch.isnan(got),
                                 (got - ref).abs() <= tolerance))
    if scaled.any():
        ratio = ((got - ref).abs() / tolerance)[scaled]
        ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
        note_worst(f"rescale {key['logits']} (err / tolerance)", float(ratio.max()),
                   f"{text} {case.name}")
    bad = (~ok).nonzero().tolist()
    report.checks += ok.numel() - len(bad)
    for row, j in bad:
        t = int(token_of_row[row])
        report.check(False, text, where, lambda row=row, j=j, t=t: (
            f"row {row} token {t} [{j}] ({KIND_NAMES[int(kinds[t])]}): x {x_rows[row, j]:.9g} "
            f"g {g[t]:.9g} w {w[t]:.9g} got {got[row, j]:.9g} ref {ref[row, j]:.9g}"))
