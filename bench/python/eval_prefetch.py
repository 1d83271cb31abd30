#!/usr/bin/env python3
"""Prefetching around an interruption of the fetch order: eight steps of the test MLP through
tierzero.torch.initialize (parameters and optimizer on NVMe, in a temporary directory), with one interruption
before the fourth step. Prints each step report's fetches, how many of them were prefetched, and the step's
time (forward, backward and step). `--width W` trains eight Linear(W, W) + tanh layers instead, where
fetching from NVMe on demand costs time to see.

  --case eval    a validation pass, `with torch.no_grad(): engine(x)`. Before the sixth session it switched
                 prefetching off for the rest of the run; since, it fetches beside the prefetch window
                 (tz::FetchFor::kEvaluation) and every training fetch stays prefetched.
  --case raise   a forward that raises at the second Linear (a batch the loop skips). Before the tenth session
                 it switched prefetching off for the rest of the run; since, engine(x) rewinds the engine's
                 fetches to where the forward began (Note [A forward that raised]).
  --case stray   one Linear called on its own under grad mode (a training fetch out of order). Before the
                 tenth session: off for the rest of the run; since, that micro-batch fetches on demand, the
                 next records the order again, and prefetching resumes (Note [A trace that stops holding]).

    python3 bench/python/eval_prefetch.py --case raise
    python3 bench/python/eval_prefetch.py --case raise --width 2048 --json out.json
"""

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "python"))
from conftest import host_config  # noqa: E402
from test_torch import _mlp_batches, mlp  # noqa: E402

import tierzero.torch as tzt  # noqa: E402


class SkippedBatch(Exception):
    pass


def interrupt(case: str, model: torch.nn.Module, engine, x: torch.Tensor) -> None:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if case == "eval":
        with torch.no_grad():
            engine(x)  # the validation pass
    elif case == "raise":
        hook = linears[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(SkippedBatch()))
        try:
            engine(x)
        except SkippedBatch:
            pass
        finally:
            hook.remove()
    else:  # stray
        linears[0](x).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=["eval", "raise", "stray"], default="eval")
    parser.add_argument("--width", type=int, default=0, help="eight Linear(W, W) layers (default: the test MLP)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write the per-step figures here")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.width:
        w = args.width
        model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(w, w), torch.nn.Tanh())])
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, w, generator=gen), torch.randn(8, w, generator=gen)) for _ in range(args.steps)]
    else:
        model = mlp()
        batches = _mlp_batches(1, args.steps)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERZERO_BENCH_NVME_DIR", "/var/tmp")) as nvme:
        config = host_config(nvme)
        config["tierzero"]["tiers"] = {"gpu_bytes": "1GiB", "cpu_bytes": "4GiB", "nvme_bytes": "8GiB"}
        params = sum(p.numel() for p in model.parameters())
        engine, *_ = tzt.initialize(model, config)
        print(f"case {args.case}: {params / 1e6:.1f}M params on NVMe, interrupted before step 3")
        print("step  fetches  prefetched  seconds")
        for i, (x, y) in enumerate(batches):
            if i == 3:
                interrupt(args.case, model, engine, x)
            start = time.perf_counter()
            engine.backward(F.mse_loss(engine(x), y))
            r = engine.step()
            seconds = time.perf_counter() - start
            rows.append({"step": i, "fetches": r["fetches"], "prefetched": r["prefetched"], "seconds": seconds,
                         "wait_nvme_seconds": r["wait_nvme_seconds"]})
            print(f"{i:4}  {r['fetches']:7}  {r['prefetched']:10}  {seconds:7.3f}")
        del engine, _, model
        gc.collect()  # the engine (held in a cycle through the model's hooks) and its swap file go before the directory
    after = [r["seconds"] for r in rows[4:]]
    if after:
        print(f"steps 4-{len(rows) - 1}: median {statistics.median(after):.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": args.case, "width": args.width, "params": params, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
