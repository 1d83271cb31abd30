#!/usr/bin/env python3
"""Host memory of tierzero.torch.initialize for a model built normally against one built on the meta device.

The model is --layers Linear(--width, --width) (fp32), initialised into an
engine whose parameters and optimizer states live on NVMe (--nvme-path), so
the engine itself keeps little in host memory. Each way runs in its own
process, which reports its peak resident memory (ru_maxrss) before and after
initialize() and the time initialize() took:

  normal  the model built on the CPU, then initialize(): every fp32 weight
          exists in host memory at once, before the engine takes it
  meta    the model built under torch.device("meta") (no memory), then
          initialize() makes it one module at a time, straight into the
          engine (Note [Models on the meta device] in bindings/tierzero/torch/meta.py)

Both ways end with the same masters (the test suite checks it bit for bit);
this measures what it costs to get there.

    python3 bench/python/meta_init_bench.py --layers 24 --width 4096 --nvme-path /var/tmp --json meta.json
    python3 bench/python/meta_init_bench.py --layers 96 --width 2048 ...   (16 MiB modules: under glibc's
                                                                              mmap threshold)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def _config(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        # Sub-groups of 50M elements: the optimizer's NVMe staging (3 sub-groups of fp32 grads, masters and
        # moments) then fits the 8 GiB CPU budget whatever else the machine is running.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 50_000_000,
                              "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "tierzero": {"backend": "host", "tiers": {"gpu_bytes": "2GiB", "cpu_bytes": "8GiB", "nvme_bytes": "64GiB"}},
    }


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _one(way: str, layers: int, width: int, nvme: str) -> dict:
    import torch

    import tierzero.torch as tzt

    def build():
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    torch.manual_seed(0)
    before = _peak_mib()
    built_at = time.perf_counter()
    if way == "meta":
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    built = _peak_mib()
    start = time.perf_counter()
    build_seconds = start - built_at
    engine, *_ = tzt.initialize(model, _config(nvme))
    seconds = time.perf_counter() - start
    return {"way": way, "params": layers * (width * width + width),
            "peak_before_mib": before, "peak_after_build_mib": built, "peak_after_initialize_mib": _peak_mib(),
            "rss_after_initialize_mib": _rss_mib(),
            "build_seconds": build_seconds, "initialize_seconds": seconds, "blocks": len(engine.block_names)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--nvme-path", default=None, help="directory for the engine's NVMe files (default: a temp dir)")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=["normal", "meta"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, args.layers, args.width, args.nvme_path)))
        return
    rows = []
    for way in ("normal", "meta"):
        with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
            out = subprocess.run([sys.executable, __file__, "--child", way, "--layers", str(args.layers),
                                  "--width", str(args.width), "--nvme-path", nvme],
                                 check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    fp32_mib = rows[0]["params"] * 4 / 2**20
    print(f"{args.layers} x Linear({args.width}, {args.width}): {rows[0]['params'] / 1e6:.1f}M params, "
          f"{fp32_mib:.0f} MiB of fp32 weights; parameters and optimizer on NVMe")
    print(f"{'way':8} {'peak after build':>18} {'peak after initialize':>22} {'resident after':>16} "
          f"{'build':>8} {'initialize':>12}")
    for r in rows:
        print(f"{r['way']:8} {r['peak_after_build_mib']:15.0f} MiB {r['peak_after_initialize_mib']:19.0f} MiB "
              f"{r['rss_after_initialize_mib']:12.0f} MiB {r['build_seconds']:6.1f} s {r['initialize_seconds']:10.1f} s")
    saved = rows[0]["peak_after_initialize_mib"] - rows[1]["peak_after_initialize_mib"]
    print(f"host memory saved by building on the meta device: {saved:.0f} MiB "
          f"({saved / fp32_mib:.2f} x the fp32 weights)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "width": args.width, "fp32_weights_mib": fp32_mib, "rows": rows,
                       "saved_mib": saved}, f, indent=1)


if __name__ == "__main__":
    main()
