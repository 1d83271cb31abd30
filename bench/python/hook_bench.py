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

It also times the engine calls alone, from Python: Engine.fetch on demand
(no step has run, so nothing was prefetched: the latency a fetch has when
prefetching cannot help) and Engine.reduce_grads of one block.

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


def engine_calls(modules: int, width: int, rounds: int = 10) -> dict:
    """Median microseconds of tierzero.Engine.fetch (on demand) and reduce_grads, over `rounds` x `modules` calls."""
    eng = tierzero.Engine(config(modules), [(f"l{i}", [("w", (width, width)), ("b", (width,))])
                                            for i in range(modules)])
    grads = [torch.ones(width, width), torch.ones(width)]

    def per_call(fn) -> float:
        samples = []
        for _ in range(rounds):
            s = time.perf_counter()
            for i in range(modules):
                fn(i)
            samples.append((time.perf_counter() - s) / modules)
        return statistics.median(samples) * 1e6

    fetch = per_call(lambda i: eng.fetch(i))
    reduce = per_call(lambda i: eng.reduce_grads(i, grads))
    return {"fetch_us": fetch, "reduce_us": reduce, "calls": rounds * modules}


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=int, default=200)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: no BLAS thread wake-ups in the tiny products, which only add noise)")
    ap.add_argument("--profile", action="store_true", help="profile the tierzero forward+backward")
    ap.add_argument("--json")
    return ap.parse_args()


def alternating_rounds(args, torch_step, tz_fwd_bwd, engine) -> dict:
    """Median ms of plain torch, tierzero forward+backward and engine.step(), and the per-module overhead.

    Rounds alternate plain torch and tierzero (forward+backward, then step, timed apart: step() must
    follow every micro-batch), so the machine's drift hits both alike; the overhead is the median of
    the rounds' differences.
    """
    for _ in range(args.warmup):
        torch_step()
    tt, fb, st = [], [], []
    for _ in range(args.repeats):
        s = time.perf_counter()
        torch_step()
        a = time.perf_counter()
        tz_fwd_bwd()
        m = time.perf_counter()
        engine.step()
        e = time.perf_counter()
        tt.append(a - s)
        fb.append(m - a)
        st.append(e - m)
    t_torch, t_fb, t_st = (statistics.median(v) * 1e3 for v in (tt, fb, st))
    diffs = sorted((f - t) / args.modules * 1e6 for f, t in zip(fb, tt))
    return {"torch_ms": t_torch, "tierzero_fwd_bwd_ms": t_fb, "tierzero_step_ms": t_st,
            "overhead_us_per_module": statistics.median(diffs),
            "overhead_quartiles_us": (diffs[len(diffs) // 4], diffs[(3 * len(diffs)) // 4])}


def print_table(args, r: dict) -> None:
    print(f"{args.modules} x Linear({args.width}, {args.width}) + tanh, batch {args.batch}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} alternating rounds")
    print(f"{'':<34}{'ms':>9}{'us/module':>11}")
    for label, key in (("torch forward+backward", "torch_ms"), ("tierzero forward+backward", "tierzero_fwd_bwd_ms"),
                       ("tierzero engine.step()", "tierzero_step_ms"),
                       ("tierzero whole micro-batch", "tierzero_micro_batch_ms")):
        print(f"{label:<34}{r[key]:>9.2f}{r[key] / args.modules * 1e3:>11.1f}")
    quartiles = r["overhead_quartiles_us"]
    print(f"overhead of tierzero.torch per module (forward+backward): {r['overhead_us_per_module']:.1f} us "
          f"(quartiles of the rounds {quartiles[0]:.1f} .. {quartiles[1]:.1f})")


def profile(tz_step) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        tz_step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def write_json(path: str, args, r: dict, calls: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"modules": args.modules, "width": args.width, "batch": args.batch, "torch_ms": r["torch_ms"],
                   "tierzero_fwd_bwd_ms": r["tierzero_fwd_bwd_ms"], "tierzero_step_ms": r["tierzero_step_ms"],
                   "tierzero_micro_batch_ms": r["tierzero_micro_batch_ms"],
                   "overhead_us_per_module": r["overhead_us_per_module"],
                   "overhead_quartiles_us": r["overhead_quartiles_us"],
                   "threads": torch.get_num_threads(), "repeats": args.repeats, "torch": torch.__version__,
                   "engine_calls": calls},
                  f, indent=2)


def main() -> None:
    args = parse_args()
    tierzero.set_log_level("warn")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width)

    plain = model(args.modules, args.width)

    def torch_step():
        plain(x).sum().backward()
        plain.zero_grad(set_to_none=True)

    engine, *_ = tzt.initialize(model(args.modules, args.width), config(args.modules))

    def tz_fwd_bwd():
        engine.backward(engine(x).sum())

    def tz_step():
        tz_fwd_bwd()
        engine.step()

    t_tz = median_ms(tz_step, args.warmup, args.repeats)  # with step: the engine's micro-batch boundary
    result = alternating_rounds(args, torch_step, tz_fwd_bwd, engine)
    result["tierzero_micro_batch_ms"] = t_tz
    print_table(args, result)
    calls = engine_calls(args.modules, args.width)
    print(f"engine calls alone: fetch on demand {calls['fetch_us']:.1f} us, reduce_grads {calls['reduce_us']:.1f} us "
          f"(median over {calls['calls']} calls)")
    if args.profile:
        profile(tz_step)
    if args.json:
        write_json(args.json, args, result, calls)


if __name__ == "__main__":
    main()
