"""tierzero.Engine: the ZeRO engine (tierzero/engine/zero.h) for Python callers.

The model is a list of blocks, each a list of named parameters; the engine
partitions their states over ranks and tiers (GPU, pinned CPU memory, NVMe)
as the config says, and drives the step:

    engine = tierzero.Engine("ds_config.json", [("layer0", [("w", (64, 64)), ("b", (64,))])],
                             init=[[w0, b0]])                 # float32 arrays, or None for zeros
    g = engine.fetch(0)                                       # the whole block, gathered
    w = torch.from_dlpack(g.param(0))                         # zero-copy view; keeps the block alive
    ...
    engine.reduce_grads(0, [dw, db])                          # copied into the engine, reduce-scattered
    report = engine.step()                                    # optimizer at the accumulation boundary

Gathered arrays are views of the engine's device buffer; the buffer goes back
to the engine when the last view is gone (Note [Gathered block lifetime] in
bindings/engine_bindings.cpp). tierzero.torch.TorchEngine is this class, driven from
module hooks.

An engine holds a swap file, memory and threads until close() (or the end of
a `with tierzero.Engine(...) as engine:` block); engines still open when the
interpreter exits are closed then (Note [Engines left open at exit]).
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from typing import Any, Mapping, Optional, Sequence, Union

from . import _core, _store


def _prefer_torch_nccl() -> None:
    # Note [One libnccl per process]
    # A CUDA build of _core loads libnccl.so.2 by its soname when it makes its
    # first NCCL communicator (Note [CUDA libraries load on first use]), and
    # torch links it, from its own nvidia-nccl wheel. The dynamic loader serves
    # every later request for that soname with the first one loaded: were ours
    # (the CUDA toolkit's, often older) first, `import torch` after that
    # fails on a missing NCCL symbol. Loading torch's NCCL first, where it is
    # installed, makes both use it (NCCL's C ABI is stable across 2.x, and the
    # newer library serves the older caller). Done only where an engine can
    # make a NCCL communicator: several ranks (the variables comm/src/env.cpp
    # reads; one rank's collectives are copies) on a machine with a GPU. Never
    # at import, and never for one rank or without a GPU, where the library
    # would only cost memory.
    import ctypes
    import importlib.util

    sizes = (os.environ.get(v, "1") for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    if all(size.strip() in ("", "1") for size in sizes):
        return
    if _core.capabilities(False)["cuda"]["device_count"] == 0:
        return
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return
    for base in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(base, "lib", "libnccl.so.2")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return

# Note [Engines left open at exit]
# Scripts and notebooks keep the engine, the model whose hooks refer to it and
# the last `loss` in module globals. At exit Python need not destroy those at
# all: the loss's autograd graph is C++ nodes, out of the garbage collector's
# sight, whose backward callbacks refer to the engine, and with it kept the
# engine was never destroyed and its swap file (the size of its NVMe states)
# stayed on disk. So every engine is listed here, weakly (the list keeps none
# alive), and those still open are closed by an atexit handler, which runs
# while the interpreter is still whole.
_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _close_open_engines() -> None:
    for engine in list(_OPEN):
        try:
            engine.close()
        except Exception as e:  # noqa: BLE001 - at exit, say so and close the rest
            warnings.warn(f"tierzero: closing an engine at exit: {e}", RuntimeWarning, stacklevel=1)


atexit.register(_close_open_engines)

BlockSpec = Sequence[Any]  # (name, [(param name, shape), ...])


def _dim(block: Any, param: Any, d: Any) -> int:
    """A dimension as an int; 2.0 is 2, but 2.7 is refused rather than cut to 2."""
    import operator

    try:
        return operator.index(d)
    except TypeError:
        if isinstance(d, float) and d.is_integer():
            return int(d)
        raise ValueError(f"blocks: {block}.{param} has dimension {d!r}, which is not a whole number") from None


def _normalise_blocks(blocks: Union[Mapping[str, Mapping[str, Sequence[int]]], Sequence[BlockSpec]]) -> list:
    pairs = blocks.items() if isinstance(blocks, Mapping) else blocks
    out = []
    for name, params in pairs:
        items = params.items() if isinstance(params, Mapping) else params
        out.append((str(name), [(str(p), tuple(_dim(name, p, d) for d in s)) for p, s in items]))
    return out


def _config_kwargs(config: Any) -> dict:
    from . import config_args

    if config is None:
        raise ValueError("Engine: a config (a path to a DeepSpeed-style JSON file, or a dict) is required")
    return config_args(config)


def _fill_params(flat: Any, block: dict, values: Sequence[Any]) -> None:
    """Writes each given parameter value (None: kept) into its run of `flat`, checked against the layout."""
    import numpy as np

    params = block["params"]
    if len(values) != len(params):
        raise ValueError(f"{len(values)} values for block '{block['name']}', which has {len(params)} parameters")
    for p, v in zip(params, values):
        if v is None:
            continue
        if hasattr(v, "detach"):  # a torch tensor, of any dtype (numpy has no bfloat16) and on any device
            v = v.detach().float().cpu().numpy()
        a = np.asarray(v, dtype=np.float32)
        if tuple(a.shape) != tuple(p["shape"]):
            raise ValueError(f"{block['name']}.{p['name']} has shape {tuple(p['shape'])}; the value given has "
                             f"{tuple(a.shape)}")
        flat[p["offset"]:p["offset"] + p["numel"]] = a.reshape(-1)


class Engine:
    """ZeRO-partitioned, tiered model states and the training step.

    config: a path or a dict (DeepSpeed keys plus the "tierzero" block; see
    docs/configuration.md). blocks: [(name, [(param name, shape)])] or
    {name: {param name: shape}}. init: per block, per parameter, a float32 CPU
    array (numpy or torch) of the parameter's size, or None for zeros. Ranks
    come from the environment as torchrun sets it (one rank without it).
    initial_values: whose init the engine keeps. "rank0" (the default, as
    DeepSpeed broadcasts rank 0's model): every rank starts from rank 0's,
    so ranks seeded apart agree; "same": the caller's word that every rank
    passes the same values (no broadcast); "later": no init at all, each
    block's values come from set_master() or load_checkpoint(), and until
    then fetch, step, gather_master and saves are refused, naming the block.
    Ranks on several machines meet through `store`, a torch.distributed Store every rank reaches; by
    default torch's own (an initialised process group's, or torchrun's at MASTER_ADDR:MASTER_PORT), else
    a rendezvous directory. `timeout` (seconds) bounds the meeting and each collective.
    Errors: ValueError (bad config or input), OSError (NVMe), MemoryError (a
    tier budget), TimeoutError (ranks that did not meet, naming them), each with the engine's message.

    close() frees the swap file, memory and threads at once; `with
    tierzero.Engine(...) as engine:` closes at the end of the block, and
    engines still open at interpreter exit are closed then.
    """

    def __init__(self, config: Any, blocks: Any, init: Optional[Sequence[Sequence[Any]]] = None, *,
                 initial_values: str = "rank0", store: Any = None, timeout: float = 300.0):
        _prefer_torch_nccl()  # Note [One libnccl per process]
        arrays = [] if init is None else [[_as_cpu_array(a) for a in block] for block in init]
        if store is None:
            store = _store.launcher_store(timeout)
        self._core = _core.Engine(blocks=_normalise_blocks(blocks), init=arrays, initial_values=initial_values,
                                  store=store, store_name=_store.describe(store) if store is not None else "",
                                  timeout=timeout, **_config_kwargs(config))
        # Rank 0 may serve the store (env:// without torchrun's agent): it lives as long as the engine.
        self._store = store
        self._layout = self._core.layout()
        _OPEN.add(self)  # Note [Engines left open at exit]

    # --- life
    def close(self) -> None:
        """Frees the engine now: its swap files, memory, threads and the ranks' communicator, whatever still
        refers to this object (a model's hooks, a module global). Arrays from fetch() still alive keep the
        engine's memory until they go (its swap files are removed at once). Every later call raises
        RuntimeError ("the engine is closed"); closing again does nothing. With several ranks, every rank
        closes (the communicator goes)."""
        _OPEN.discard(self)
        self._core.close()

    @property
    def closed(self) -> bool:
        """Whether close() has been called (or a with block around the engine has ended)."""
        return self._core.closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the step
    def fetch(self, block: int, *, stream: Optional[int] = None, evaluation: bool = False) -> _core.GatheredBlock:
        """The whole block gathered on the engine's device; .data and .param(i) are zero-copy arrays.

        The buffer goes back to the engine when the last view of it is gone.
        On CUDA, kernels reading it may still be queued then: the engine
        reuses it only after the work queued by then on `stream`, the stream
        that reads it, given as for reduce_grads (unset: the legacy default
        stream; -1: the caller synchronises before letting the last view go).

        evaluation=True marks a fetch outside training's order (a forward with no backward, between steps):
        it is fetched on demand and leaves the order the engine prefetches by alone, where a training fetch
        out of that order would pause prefetching for two micro-batches while the order is recorded again.
        """
        return self._core.fetch(block, stream=stream, evaluation=evaluation)

    def reduce_grads(self, block: int, grads: Sequence[Any], *, stream: Optional[int] = None) -> None:
        """Hands the block's gradients (one array per parameter, or None) to the engine (copied).

        On CUDA the copies wait for the work queued so far on `stream`, the
        stream that wrote the gradients, given as DLPack gives streams: an int
        (`torch.cuda.current_stream().cuda_stream`, `cupy.cuda.get_current_stream().ptr`;
        0 or 1 the legacy default stream, 2 the per-thread one, -1 when the
        caller has synchronised). Unset: the legacy default stream, where torch and
        CuPy work unless told otherwise. The call returns when the copies are
        done, so the arrays may be reused or freed at once.
        """
        self._core.reduce_grads(block, [None if g is None else _as_array(g) for g in grads], stream=stream)

    def step(self) -> dict:
        """Ends a micro-batch; at the accumulation boundary runs the optimizer. The step report as a dict
        ("lr" is the learning rate the optimizer step used, 0 when none ran)."""
        return self._core.step()

    def fetch_mark(self) -> _core.FetchMark:
        """Where this micro-batch's training fetches have got to: where rewind_fetches() goes back to."""
        return self._core.fetch_mark()

    def rewind_fetches(self, mark: _core.FetchMark) -> None:
        """After a forward that raised half-way: forgets the training fetches since `mark` (fetch_mark()
        taken before it, in this micro-batch), so the order the engine prefetches by goes on from there.

        Without it the next forward breaks that order and prefetching pauses for two micro-batches while it is
        recorded again. Gradients already handed over stay. Every rank rewinds at the same point or none does
        (the prefetch window's all-gathers are collectives: one rank rewinding alone would post them at other
        points than the rest). A mark from another micro-batch is a ValueError.
        """
        self._core.rewind_fetches(mark)

    def set_learning_rate(self, lr: float) -> None:
        """The optimizer's learning rate for the next steps (>= 0; checkpoints carry it once set); refused
        (ValueError) when the config has a scheduler."""
        self._core.set_learning_rate(float(lr))

    def set_weight_decay(self, block: int, param: int, weight_decay: float) -> None:
        """Parameter `param` of `block` (indices, as layout() lists them) steps with this weight decay (finite,
        >= 0) in place of the config's optimizer.params.weight_decay: torch param groups that differ in it.
        A hyperparameter, not a state: checkpoints do not carry it, and every rank must set the same values
        (Note [Weight decay per parameter] in engine/src/optimizer_step.cpp)."""
        self._core.set_weight_decay(int(block), int(param), float(weight_decay))

    def weight_decay(self, block: int, param: int) -> float:
        """The weight decay parameter `param` of `block` steps with (the config's unless set)."""
        return self._core.weight_decay(int(block), int(param))

    # --- state
    def save_checkpoint(self, directory: Union[str, os.PathLike], tag: Optional[str] = None, *,
                        client_state: Optional[bytes] = None, save_latest: bool = True, keep_last: int = 0) -> str:
        """Every rank's states under directory/<tag> (default "step-<N>", a fresh name; saving under an
        existing tag replaces that checkpoint atomically), with rank 0's client_state bytes, and
        directory/latest pointed at it unless save_latest is False. keep_last=N then keeps the newest N
        complete checkpoints under directory (0: all; never removes the one latest names). A collective.
        Returns its directory."""
        return self._core.save_checkpoint(os.fspath(directory), tag=tag, client_state=client_state,
                                          save_latest=save_latest, keep_last=int(keep_last))

    def load_checkpoint(self, directory: Union[str, os.PathLike], tag: Optional[str] = None, *,
                        weights_only: bool = False) -> tuple:
        """Loads directory/<tag>, or directory/latest (or directory itself when it is a checkpoint); every
        checksum is verified before any state is replaced. weights_only: the weights alone (this engine's
        optimizer moments, step count and learning rate stay as they are, fresh on a new engine; the
        checkpoint's optimizer may differ). Returns (its directory, the
        client_state bytes saved with it, or None)."""
        return self._core.load_checkpoint(os.fspath(directory), tag=tag, weights_only=weights_only)

    def export_safetensors(self, path: Union[str, os.PathLike], names: Optional[Sequence[Sequence[str]]] = None) -> None:
        """The fp32 weights as one safetensors file: tensors named "<block>.<param>", or names[b][p]
        (one list per block, one name per parameter). Rank 0 writes it (atomically)."""
        if names is not None:
            if isinstance(names, (str, bytes)) or not len(names):
                raise TypeError("export_safetensors: names must be one list of names per block (or None)")
            for b, block in enumerate(names):
                if isinstance(block, (str, bytes)):
                    raise TypeError(f"export_safetensors: names[{b}] is the string {block!r}; it must be a list "
                                    "of that block's tensor names")
            names = [list(block) for block in names]
        self._core.export_safetensors(os.fspath(path), names)

    def gather_master(self, block: int):
        """The block's fp32 master weights as a numpy array (whole_numel,), a copy."""
        return self._core.gather_master(block)

    def has_values(self, block: int) -> bool:
        """Whether the block has values: False only with initial_values="later", until set_master_params()
        or load_checkpoint() sets it."""
        return self._core.has_values(block)

    def master_params(self, block: int) -> list:
        """The block's fp32 master weights, one numpy array per parameter, shaped."""
        flat = self.gather_master(block)
        return [flat[p["offset"]:p["offset"] + p["numel"]].reshape(p["shape"]) for p in self._layout[block]["params"]]

    def set_master_params(self, block: int, values: Sequence[Any], *, root: int = 0) -> None:
        """Replaces the block's fp32 master weights (and the 16-bit parameters made from them) with rank
        `root`'s `values`: one array per parameter, of its shape (any float dtype, on any device: copied), or
        None to keep that parameter. A collective: every rank calls it with the same block and root (the
        other ranks' values are not used). Adam's moments, the step count and accumulated gradients stay.
        Refused while a gathered block is alive; not for use between a forward and its backward. On a block
        with no values yet (initial_values="later") every parameter needs one."""
        import numpy as np

        has_values = self._core.has_values(block)  # the same on every rank
        if has_values:
            flat = self.gather_master(block)  # a collective: every rank, before anything can fail here
        else:  # set_master refuses a block that does not exist
            flat = np.zeros(self._layout[block]["whole_numel"] if 0 <= block < len(self._layout) else 0, np.float32)
        try:
            if not has_values and self._core.rank == root:  # the others' values go unused
                for p, v in zip(self._layout[block]["params"], values):
                    if v is None:
                        raise ValueError(f"block '{self._layout[block]['name']}' has no values yet "
                                         f"(initial_values='later'), so every parameter needs one; "
                                         f"'{p['name']}' is None")
            _fill_params(flat, self._layout[block], values)
        except Exception as e:  # noqa: BLE001 - whatever it is, every rank must hear of it
            # Through the collective, so the other ranks fail with this one instead of waiting for it.
            self._core.set_master(block, flat, root=root, refusal=f"set_master_params: {e}")
            raise AssertionError("unreachable: the refused set_master raises") from e
        self._core.set_master(block, flat, root=root)

    # --- facts
    @property
    def layout(self) -> list:
        """Per block: name, params (name, shape, offset, numel), shard_numel, whole_numel, persistent."""
        return self._layout

    @property
    def blocks(self) -> int:
        return len(self._layout)

    @property
    def loss_scale(self) -> float:
        return self._core.loss_scale

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (derived from train_batch_size and the ranks where the config
        gives that instead, as DeepSpeed does)."""
        return self._core.gradient_accumulation_steps

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps not counted; restored by load_checkpoint)."""
        return self._core.optimizer_steps

    @property
    def learning_rate(self) -> float:
        """The learning rate the next optimizer step will use (the config's scheduler, or the optimizer's)."""
        return self._core.learning_rate

    @property
    def param_dtype(self) -> str:
        return self._core.param_dtype

    @property
    def grad_dtype(self) -> str:
        return self._core.grad_dtype

    @property
    def device(self) -> str:
        return self._core.device

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    def describe(self) -> str:
        return self._core.describe()

    def record_timeline(self, on: bool = True) -> None:
        self._core.record_timeline(on)

    def write_timeline(self, path: Union[str, os.PathLike]) -> None:
        self._core.write_timeline(os.fspath(path))


def _as_array(a: Any) -> Any:
    # torch refuses to export a tensor that requires grad through DLPack;
    # detach() is a view of the same memory.
    return a.detach() if hasattr(a, "detach") else a


def _as_cpu_array(a: Any) -> Any:
    return None if a is None else _as_array(a)
