#!/usr/bin/env python3
"""Prefetching around a validation pass: six steps of the test MLP through tierzero.torch.initialize (parameters
and optimizer on NVMe, in a temporary directory), one `with torch.no_grad(): engine(x)` before the fourth step.
Prints each step report's fetches and how many of them were prefetched. Before the sixth session the validation
pass switched prefetching off for the rest of the run (and the engine logged why); since, it fetches beside the
prefetch window (tz::FetchFor::kEvaluation) and every training fetch stays prefetched.

    python3 bench/python/eval_prefetch.py
"""

import gc
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "python"))
from conftest import host_config  # noqa: E402
from test_torch import _mlp_batches, mlp  # noqa: E402

import tierzero.torch as tzt  # noqa: E402

torch.manual_seed(0)
with tempfile.TemporaryDirectory() as nvme:
    engine, _ = tzt.initialize(mlp(), host_config(nvme))
    print("step  fetches  prefetched")
    for i, (x, y) in enumerate(_mlp_batches(1, 6)):
        if i == 3:
            with torch.no_grad():
                engine(x)  # the validation pass
        engine.backward(F.mse_loss(engine(x), y))
        r = engine.step()
        print(f"{i:4}  {r['fetches']:7}  {r['prefetched']:10}")
    del engine, _
    gc.collect()  # the engine (held in a cycle through the model's hooks) and its swap file go before the directory
