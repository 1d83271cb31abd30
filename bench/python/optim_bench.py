#!/usr/bin/env python3
"""tierzero.optim.AdamW.step() against torch.optim.AdamW on CPU, for 100M+ parameters.

Each row times one optimizer step over the same model (`--params` fp32
parameters split into tensors of `--tensor` elements), median of --repeats
after --warmup steps, and reports the step's time, its effective memory
traffic (bytes the step must read and write at least, over its time) and the
ratio torch / tierzero for the same work:

  fp32            the plain step: tierzero.optim.AdamW vs torch.optim.AdamW(fused=True)
                  (and torch's default foreach). Both stream 16 B/param in, 12 out:
                  memory-bound, so the ratio is the ratio of achieved bandwidths.
  fp32 + bf16 out the mixed-precision step's optimizer part (ZeRO-Offload's CPU step):
                  the new parameters also rounded to bf16 for the model. tierzero: one
                  fused pass (param16_dtype=torch.bfloat16); torch: fused step, then
                  p16.copy_(p) per tensor (a second pass over the parameters).
  bf16 grads      as above with bf16 gradients (what a bf16 model produces): tierzero
                  reads them as they are; torch.optim needs fp32 gradients, so a cast
                  pass g32.copy_(g16) comes first.

    python3 bench/python/optim_bench.py --params 100M --json optim.json

Threads: both use every CPU this process may (torch.get_num_threads(),
tierzero's kernels threads=0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import tierzero
import tierzero.optim as tzo


def count(text: str) -> int:
    return int(round(tierzero._core.parse_count(text)))


def make_params(n: int, chunk: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]


def timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fp32_rows(n, chunk, warmup, repeats):
    params = make_params(n, chunk, 0)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    ours = tzo.AdamW(params, lr=1e-4)
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    foreach = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    bytes_moved = 28 * n  # read p, g, m, v; write p, m, v
    rows = {"tierzero": timed(ours.step, warmup, repeats), "torch fused": timed(fused.step, warmup, repeats),
            "torch foreach": timed(foreach.step, warmup, repeats)}
    return rows, bytes_moved, ours.simd


def copy_out_rows(n, chunk, warmup, repeats, bf16_grads: bool):
    params = make_params(n, chunk, 1)
    grads16 = [torch.randn_like(p).mul_(1e-3).to(torch.bfloat16) for p in params]
    grads32 = [g.float() for g in grads16]
    for p, g in zip(params, grads16 if bf16_grads else grads32):
        if bf16_grads:
            p.grad_dtype = None  # torch >= 2.10 refuses a gradient of another dtype unless told
        p.grad = g
    ours = tzo.AdamW(params, lr=1e-4, param16_dtype=torch.bfloat16)
    ours_time = timed(ours.step, warmup, repeats)
    # torch: the same work in the passes torch has.
    ref_params = make_params(n, chunk, 1)
    p16 = [p.detach().to(torch.bfloat16) for p in ref_params]
    for p, g in zip(ref_params, grads32):
        p.grad = g.clone()
    fused = torch.optim.AdamW(ref_params, lr=1e-4, fused=True)

    @torch.no_grad()
    def torch_step():
        if bf16_grads:
            for p, g in zip(ref_params, grads16):
                p.grad.copy_(g)  # torch.optim wants fp32 gradients for fp32 parameters
        fused.step()
        for h, p in zip(p16, ref_params):
            h.copy_(p)

    torch_time = timed(torch_step, warmup, repeats)
    bytes_moved = (26 if bf16_grads else 28) * n + 2 * n
    return {"tierzero": ours_time, "torch fused": torch_time}, bytes_moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="100M", help="fp32 parameters in the model (default 100M)")
    ap.add_argument("--tensor", default="4M", help="elements per parameter tensor (default 4M)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args()
    n, chunk = count(args.params), count(args.tensor)
    tierzero.set_log_level("warn")

    results = []
    rows, nbytes, simd = fp32_rows(n, chunk, args.warmup, args.repeats)
    results.append(("fp32", rows, nbytes))
    rows, nbytes = copy_out_rows(n, chunk, args.warmup, args.repeats, bf16_grads=False)
    results.append(("fp32 + bf16 out", rows, nbytes))
    rows, nbytes = copy_out_rows(n, chunk, args.warmup, args.repeats, bf16_grads=True)
    results.append(("bf16 grads + bf16 out", rows, nbytes))

    print(f"AdamW step, {n / 1e6:.0f}M fp32 params in tensors of {chunk / 1e6:.0f}M; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), tierzero kernels {simd}; median of {args.repeats}")
    print(f"{'variant':<24}{'optimizer':<16}{'ms/step':>10}{'ns/param':>10}{'GB/s':>8}{'torch/tierzero':>16}")
    out = []
    for variant, rows, nbytes in results:
        for name, t in rows.items():
            ratio = t / rows["tierzero"]
            print(f"{variant:<24}{name:<16}{t * 1e3:>10.1f}{t / n * 1e9:>10.3f}{nbytes / t / 1e9:>8.1f}"
                  f"{'' if name == 'tierzero' else f'{ratio:>15.2f}x'}")
            out.append({"variant": variant, "optimizer": name, "seconds": t, "ns_per_param": t / n * 1e9,
                        "gbps": nbytes / t / 1e9, "bytes": nbytes, "torch_over_tierzero": ratio})
    if args.json:
        meta = {"params": n, "tensor": chunk, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "simd": simd, "cpu": tierzero.info()["cpu"]["model"], "nproc": os.cpu_count(),
                "python": platform.python_version(), "repeats": args.repeats}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": out}, f, indent=2)


if __name__ == "__main__":
    main()
