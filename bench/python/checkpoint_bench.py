#!/usr/bin/env python3
"""Host memory and time of an engine's save_checkpoint, load_checkpoint and export_safetensors.

The engine holds --blocks blocks of one (--width, --width) fp32 weight each,
with parameters and optimizer states on NVMe (--nvme-path), so the engine
itself keeps little in host memory: what an operation adds on top is what it
stages. One optimizer step with random gradients comes first (so the moments
are not zeros); its report gives the CPU pool's peak, which the optimizer's
NVMe staging dominates. For each operation the process's peak resident memory is reset
(/proc/self/clear_refs) and read back after (VmHWM), so the table shows the
peak each one reached above the resident memory it started from, next to
the bytes it moved:

  save    this rank's fp32 master, exp_avg and exp_avg_sq, read from NVMe and
          written to <dir>/bench (checksummed, fsynced)
  load    the same files read, verified and written back to the NVMe tier
  export  the fp32 model gathered block by block into one .safetensors file

    python3 bench/python/checkpoint_bench.py --blocks 16 --width 4096 --nvme-path /var/tmp/tzb --json ckpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def _config(nvme: str, cpu_bytes: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "tierzero": {"backend": "host", "tiers": {"gpu_bytes": "2GiB", "cpu_bytes": cpu_bytes, "nvme_bytes": "64GiB"}},
    }


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure(what: str, fn, moved_bytes: int) -> dict:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return {"op": what, "seconds": seconds, "peak_above_start_mib": _status_mib("VmHWM") - before,
            "bytes": moved_bytes, "gb_per_s": moved_bytes / seconds / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--nvme-path", default=None, help="directory for the engine's NVMe files and the checkpoint")
    ap.add_argument("--cpu-bytes", default="16GiB", help="the engine's CPU budget (tierzero.tiers.cpu_bytes)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import numpy as np

    import tierzero

    rng = np.random.default_rng(0)
    blocks = {f"layer{i}": {"weight": [args.width, args.width]} for i in range(args.blocks)}
    params = args.blocks * args.width * args.width
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as root:
        os.mkdir(root + "/nvme")
        engine = tierzero.Engine(_config(root + "/nvme", args.cpu_bytes), blocks, initial_values="later")
        for b in range(args.blocks):  # one block's values in memory at a time
            engine.set_master_params(b, [rng.standard_normal((args.width, args.width), dtype=np.float32)])
        for b in range(args.blocks):
            engine.reduce_grads(b, [rng.standard_normal((args.width, args.width), dtype=np.float32)])
        start = time.perf_counter()
        report = engine.step()
        step = {"seconds": time.perf_counter() - start, "peak_cpu_pool_bytes": report["peak_cpu_bytes"]}
        states = 3 * params * 4
        rows = [
            _measure("save", lambda: engine.save_checkpoint(root + "/ckpt", "bench"), states),
            _measure("load", lambda: engine.load_checkpoint(root + "/ckpt", "bench"), states),
            _measure("export", lambda: engine.export_safetensors(root + "/model.safetensors"), params * 4),
        ]
        shutil.rmtree(root + "/ckpt")
        del engine  # its swap files go before their directory does
    state_mib = states / 2**20
    print(f"{args.blocks} blocks x ({args.width}, {args.width}) fp32: {params / 1e6:.1f}M params, "
          f"{state_mib:.0f} MiB of fp32 states (master, exp_avg, exp_avg_sq); parameters and optimizer on NVMe")
    print(f"one step: {step['seconds']:.2f} s, CPU pool peak {step['peak_cpu_pool_bytes'] / 2**30:.2f} GiB")
    print(f"{'op':8} {'seconds':>8} {'GB/s':>6} {'peak above start':>18} {'x states':>9}")
    for r in rows:
        print(f"{r['op']:8} {r['seconds']:8.2f} {r['gb_per_s']:6.2f} {r['peak_above_start_mib']:14.0f} MiB "
              f"{r['peak_above_start_mib'] / state_mib:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blocks": args.blocks, "width": args.width, "params": params, "state_mib": state_mib,
                       "step": step, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
