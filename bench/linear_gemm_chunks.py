"""The GEMMs of linear cross entropy's chunked schedule alone, no loss kernel (issue 18): per chunk
size, logits = h W^T, dh = G W and dW += G^T h (``addmm_`` into a bf16 dW after the first chunk),
timed together and each alone, against the three unchunked GEMMs; and a scale pass over dW.
bf16, H = 4096, V = 128256, median of 5 with CUDA events.

Usage (GPU machine): python3 bench/linear_gemm_chunks.py [N]   (default N = 8192)
"""
import sys
import time

import torch

N, H, V = int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 4096, 128256
dev = "cuda"
print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
torch.manual_seed(0)
h = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
W = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02
dW = torch.empty_like(W)
def timeit(fn, reps=5):
    ts = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts = sorted(ts[2:]); return ts[len(ts)//2]
def full():
    L = h @ W.T
    dh = L @ W
    torch.mm(L.T, h, out=dW)
print(f"N={N} three unchunked GEMMs: {timeit(full):.2f} ms")
for c in (512, 1024, 1046, 2048, 4096):
    buf = torch.empty(c, V, device=dev, dtype=torch.bfloat16)
    dh = torch.empty(N, H, device=dev, dtype=torch.bfloat16)
    def chunked(only=None):
        for s in range(0, N, c):
            e = min(N, s + c)
            L = buf[: e - s]
            if only in (None, "logits"): torch.mm(h[s:e], W.T, out=L)
            if only in (None, "dh"): torch.mm(L, W, out=dh[s:e])
            if only in (None, "dw"):
                if s == 0: torch.mm(L.T, h[s:e], out=dW)
                else: dW.addmm_(L.T, h[s:e])
    parts = {k: timeit(lambda k=k: chunked(k)) for k in ("logits", "dh", "dw")}
    print(f"chunk {c}: all {timeit(chunked):.2f} ms; logits {parts['logits']:.2f} dh {parts['dh']:.2f} dW {parts['dw']:.2f}")
L = torch.empty(N, V, device=dev, dtype=torch.bfloat16)
print(f"unchunked parts: logits {timeit(lambda: torch.mm(h, W.T, out=L)):.2f} dh {timeit(lambda: torch.mm(L, W)):.2f} dW {timeit(lambda: torch.mm(L.T, h, out=dW)):.2f}")
print(f"dW *= 0.5 (the scale pass): {timeit(lambda: dW.mul_(0.5)):.3f} ms")
