#!/usr/bin/env python3
"""Does freeing each block's memory back to the system (malloc_trim) matter when a model built on the meta device
is made (Note [Models on the meta device] in bindings/tierzero/torch/meta.py)?

Each way runs in its own process: --layers Linear(--width, --width) built under torch.device("meta"), made by
tierzero.torch.initialize with the meta_init_bench.py config (parameters and optimizer on NVMe); "without" replaces
tierzero.torch.meta._malloc_trim by a no-op. Prints peak resident memory (ru_maxrss) after initialize().

    python3 bench/python/meta_trim_check.py --layers 40 --width 2048 --nvme-path /var/tmp/tzb
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile

from meta_init_bench import _config


def _child(trim: bool, layers: int, width: int, nvme: str) -> float:
    import torch

    import tierzero.torch as tzt

    if not trim:
        tzt.meta._malloc_trim = lambda: None
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    tzt.initialize(model, _config(nvme))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--child", choices=["with", "without"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child == "with", args.layers, args.width, args.nvme_path)))
        return
    print(f"{args.layers} x Linear({args.width}, {args.width}) built on the meta device: peak resident memory")
    for way in ("with", "without"):
        with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
            out = subprocess.run([sys.executable, __file__, "--child", way, "--layers", str(args.layers),
                                  "--width", str(args.width), "--nvme-path", nvme],
                                 check=True, capture_output=True, text=True).stdout
        print(f"  {way:7} malloc_trim: {float(out.strip().splitlines()[-1]):.0f} MiB")


if __name__ == "__main__":
    main()
