"""Where Python ranks meet: torch's c10d store, when the job has one.

Ranks on different machines share no directory; torchrun serves a TCPStore at
MASTER_ADDR:MASTER_PORT for its workers, and an initialised torch.distributed
process group has its own. Engine() hands the engine that store (Note [Store
rendezvous] in comm/src/store_rendezvous.cpp); without one, ranks meet in the
rendezvous directory (one machine, or a shared file system).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Optional


def describe(store: Any) -> str:
    """'torch TCPStore at 10.0.0.1:29500': how errors and the log name a store."""
    inner = store
    while hasattr(inner, "underlying_store"):  # PrefixStore
        inner = inner.underlying_store
    kind = f"torch {type(inner).__name__}" if type(inner).__module__.startswith("torch") else type(inner).__name__
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return f"{kind} at {host}:{port}" if host is not None and port is not None else kind


def launcher_store(timeout_s: float) -> Optional[Any]:
    """torch's store for this job, or None. In order: the default store of an initialised torch.distributed
    process group; under torchrun (TORCHELASTIC_RUN_ID set) with WORLD_SIZE > 1, the store torch's env://
    rendezvous opens at MASTER_ADDR:MASTER_PORT (torchrun's own, or one that rank 0 serves, as
    torch.distributed.init_process_group would). TimeoutError naming the address when it cannot be reached."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if not os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from torch.distributed.rendezvous import rendezvous  # the function; torch.distributed.rendezvous is it too

    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    try:
        store, _, _ = next(rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
        raise TimeoutError(f"tierzero: rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} could not "
                           f"reach torchrun's store at MASTER_ADDR={addr} MASTER_PORT={port} within {timeout_s:g} s "
                           f"(is the port open between the machines?): {e}") from e
    return store
