#!/usr/bin/env python3
"""The cost tierzero.torch adds per module: a model of many tiny modules, forward+backward, against plain torch.

The model is --modules Linear(--width, --width) layers (each one engine
block) with a tanh between them; each step is one forward and backward of a
(--batch, --width) input. The same model trains three ways:

  torch           plain torch (the floor: the math itself)
  tierzero        tierzero.torch.initialize with every state on the "GPU" tier
                  (the Host backend: host memory), stage 3 with no persistent
                  blocks, so every module's forward and backward fetch, view,
                  release and reduce its block through the engine
  tierzero, step  the same plus engine.step() (the optimizer)

and the overhead per module is (tierzero - torch) / modules. Widths are tiny
so the math is negligible and the figure is the per-module cost of the hooks
and the engine calls. --profile prints where the Python time goes.

    python3 bench/python/hook_bench.py --modules 200 --width 16 --json hooks.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import tierzero
import tierzero.torch as tzt


def model(modules: int, width: int) -> torch.nn.Module:
    layers = []
    for _ in range(modules):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def config(modules: int) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "tierzero": {"backend": "host", "placement": "auto"}}


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=int, default=200)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="profile the tierzero forward+backward")
    ap.add_argument("--json")
    args = ap.parse_args()
    tierzero.set_log_level("warn")
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width)

    plain = model(args.modules, args.width)

    def torch_step():
        plain(x).sum().backward()
        plain.zero_grad(set_to_none=True)

    engine, _ = tzt.initialize(model(args.modules, args.width), config(args.modules))

    def tz_fwd_bwd():
        engine.backward(engine(x).sum())

    def tz_step():
        tz_fwd_bwd()
        engine.step()

    t_torch = median_ms(torch_step, args.warmup, args.repeats)
    t_tz = median_ms(tz_step, args.warmup, args.repeats)  # with step: the engine's micro-batch boundary
    # forward+backward alone: step() must follow every micro-batch, so time the two parts of each.
    fb, st = [], []
    for _ in range(args.repeats):
        s = time.perf_counter()
        tz_fwd_bwd()
        m = time.perf_counter()
        engine.step()
        e = time.perf_counter()
        fb.append(m - s)
        st.append(e - m)
    t_fb, t_st = statistics.median(fb) * 1e3, statistics.median(st) * 1e3
    per_module_us = (t_fb - t_torch) / args.modules * 1e3
    print(f"{args.modules} x Linear({args.width}, {args.width}) + tanh, batch {args.batch}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"{'':<34}{'ms':>9}{'us/module':>11}")
    print(f"{'torch forward+backward':<34}{t_torch:>9.2f}{t_torch / args.modules * 1e3:>11.1f}")
    print(f"{'tierzero forward+backward':<34}{t_fb:>9.2f}{t_fb / args.modules * 1e3:>11.1f}")
    print(f"{'tierzero engine.step()':<34}{t_st:>9.2f}{t_st / args.modules * 1e3:>11.1f}")
    print(f"{'tierzero whole micro-batch':<34}{t_tz:>9.2f}{t_tz / args.modules * 1e3:>11.1f}")
    print(f"overhead of tierzero.torch per module (forward+backward): {per_module_us:.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            tz_step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"modules": args.modules, "width": args.width, "batch": args.batch, "torch_ms": t_torch,
                       "tierzero_fwd_bwd_ms": t_fb, "tierzero_step_ms": t_st, "tierzero_micro_batch_ms": t_tz,
                       "overhead_us_per_module": per_module_us, "torch": torch.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
