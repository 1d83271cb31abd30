"""One rank of tierzero.torch training, as torchrun starts it (tests/multinode/torchrun_two_hosts.sh).

Each rank trains a small MLP on its half of every batch (the same batches on every rank, from a fixed seed),
parameters and optimizer states partitioned between the ranks and offloaded to NVMe (its own /tmp folder).
Rank 0 writes the trained master weights to OUT (torch.save) and prints each step's loss.

    torch_worker.py OUT TIMEOUT_S
TZ_TEST_NEVER_ARRIVE=<rank>: that rank sleeps instead of creating its engine (the test's missing rank).
"""

import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import tierzero.torch as tzt

out, timeout_s = sys.argv[1], float(sys.argv[2])
rank = int(os.environ["RANK"])
if os.environ.get("TZ_TEST_NEVER_ARRIVE") == str(rank):
    time.sleep(600)
# The swap files: not in the host's own /tmp (a tmpfs, without O_DIRECT), and gone at exit.
scratch = tempfile.TemporaryDirectory(prefix=f"tz-nvme-rank{rank}-", dir=os.environ.get("TZ_NVME_DIR", "/var/tmp"))
nvme = scratch.name
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 50_000,
                          "offload_param": {"device": "nvme", "nvme_path": nvme},
                          "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
    "tierzero": {"backend": "host", "tiers": {"gpu_bytes": "64MiB", "cpu_bytes": "128MiB", "nvme_bytes": "256MiB"}},
}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
engine, *_ = tzt.initialize(model, config, timeout=timeout_s)
print(f"rank {rank}: {engine.describe()}", flush=True)
gen = torch.Generator().manual_seed(5)
for step in range(4):
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    mine = slice(rank * 4, rank * 4 + 4)
    loss = F.mse_loss(engine(x[mine]), y[mine])
    engine.backward(loss)
    engine.step()
    print(f"rank {rank} step {step} loss {loss.item()!r}", flush=True)
master = engine.master_state_dict()
if rank == 0:
    torch.save(master, out)
engine.close()
scratch.cleanup()
print(f"rank {rank} done", flush=True)
