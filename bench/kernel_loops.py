"""Timing shared by the benchmarks. `timed`, for the A/B benchmarks (outputs_ab.py,
softcap_ab.py): the median
time per call of back-to-back calls between two CUDA events, several functions' loops
interleaved after a warm-up so that each sees the same clocks (an idle H200 starts at a low SM
clock, and its first second of full load runs under the driver's software power cap: clocks of
1500-1965 MHz, nvidia-smi's clocks_event_reasons 0x4; docs/perf-log/
2026-12-03-1711-softcap-exp-api-peers.md, which slows a compute-bound kernel more than a
memory-bound one). On the CPU (a dry run of a harness) wall-clock time and no warm-up.
`single_calls`, for the API benchmarks (softcap_bench.py, logit_scale_bench.py): one call at a
time between two CUDA events, each call's inputs made outside the timed region.
"""

from __future__ import annotations

import statistics
import time


def loop_ms(torch, fn, calls: int, cuda: bool) -> float:
    """ms per call of `calls` back-to-back calls of `fn`."""
    if cuda:
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e3 / calls


def timed(torch, fns, cuda: bool, *, warm_s: float = 1.5, calls: int = 20,
          loops: int = 7) -> list:
    """Median ms per call of each of `fns`: `fns` run in turn for about `warm_s` seconds, then
    `loops` rounds of `calls` calls each, the functions' loops interleaved (A B A B ...)."""
    deadline = time.perf_counter() + (warm_s if cuda else 0.0)
    while True:
        for fn in fns:
            fn()
        if cuda:
            torch.cuda.synchronize()
        if time.perf_counter() >= deadline:
            break
    samples = [[] for _ in fns]
    for _ in range(loops):
        for k, fn in enumerate(fns):
            samples[k].append(loop_ms(torch, fn, calls, cuda))
    return [statistics.median(one) for one in samples]


def single_calls(torch, step, setup, reps: int, cuda: bool, warm: int = 3) -> float:
    """Median ms of `reps` single calls `step(setup())` after `warm` untimed ones; `setup`
    runs before each call, outside the timed region (a synchronize between them)."""
    samples = []
    for rep in range(reps + warm):
        state = setup()
        if cuda:
            torch.cuda.synchronize()
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            step(state)
            end.record()
            torch.cuda.synchronize()
            ms = begin.elapsed_time(end)
        else:
            start = time.perf_counter()
            step(state)
            ms = (time.perf_counter() - start) * 1e3
        if rep >= warm:
            samples.append(ms)
    return statistics.median(samples)
