"""TorchEngine's checkpoints: the engine's states, and beside them the model's buffers and frozen parameters
and the caller's client_state (Note [Client state]); and the weights as one safetensors file.

Note [Client state]
The engine checkpoints what it holds; the rest of a model's state_dict()
(buffers such as a norm's running statistics, frozen parameters) and a dict
of the caller's (client_state, as DeepSpeed's save_checkpoint takes it) go in
the checkpoint's client state: torch.save's bytes, which rank 0 writes into
the checkpoint directory with a checksum before it is published, so they and
the weights are saved, replaced and verified together. They are read back
with torch.load(weights_only=True), which runs no code from the file;
save_checkpoint tries that read first and refuses a dict it could not read
back (an arbitrary object, say), on every rank, before anything is written.
load_checkpoint reads them first (files only, checksum verified), decodes
them and checks the buffers' names and shapes against the model, then loads:
a rank's refusal goes into the collective load, which fails on every rank
before anything is replaced, and the load checks it finds the same bytes. No
Python runs inside the engine's call (Note [Engine calls and the GIL]).
Tensors come back on the CPU, and are copied into the model's own.

Note [State dicts after initialize]
Between forwards a trained parameter holds an empty placeholder (Note
[Parameters live in the engine]), so torch's state_dict() would hold empty
tensors, and model.save_pretrained(), torch.save(model.state_dict()) or
safetensors' save_model would write them without a word. Every module that
holds a trained parameter (its owner, and a module it is tied into) gets a
state_dict post-hook that puts the parameter's full value in its place: the
engine's master weights, gathered (gather_master) and cast to the model's
dtype, on the CPU (as DeepSpeed's consolidated 16-bit state dict gives them),
each tied name its own tensor of the same value. Inside GatheredParameters
the parameter's live (possibly edited) value is kept. keep_vars=True gets the
same tensors (not the Parameters: those are placeholders). On several ranks
gathering is a collective: every rank calls state_dict(), as every rank calls
save_checkpoint; one rank alone meets the engine's timeout, naming the
gather. After close() the hook raises (the weights were the engine's); after
detach_module() the hooks are gone and the parameters hold the weights.
load_state_dict() into the engine's parameters is refused by name (a
placeholder cannot take a value): load before initialize(), or write through
GatheredParameters / safe_set_full_fp32_param, or engine.load_checkpoint.
The engine's own reads of the model's state (a checkpoint's buffers and
frozen parameters) go around the hook (_raw_state).
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
import weakref
from typing import Any, Optional, Union

import torch

from .. import _core


class _Checkpoints:
    """TorchEngine's save_checkpoint, load_checkpoint and export_safetensors, as DeepSpeed's engine takes
    them, in place of tierzero.Engine's (the next class in TorchEngine's order). Uses the engine's _core,
    module, _slot (the trained parameters), _blocks, optimizer and step counters."""

    def save_checkpoint(self, save_dir: Union[str, os.PathLike], tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, *,
                        keep_last: int = 0) -> bool:
        """Every rank's master weights, optimizer moments, step, learning rate and loss scale under
        save_dir/<tag> (default "step-<N>"), as DeepSpeed's save_checkpoint: saving under an existing tag
        replaces that checkpoint atomically, and save_dir/latest points at it unless save_latest is False.
        Rank 0 adds the model's buffers and frozen parameters (those too unless exclude_frozen_parameters)
        and client_state, a dict of yours (an epoch, a data loader's position) that load_checkpoint
        returns (Note [Client state]). keep_last=N (tierzero's; as Hugging Face's save_total_limit) then
        keeps the newest N complete checkpoints under save_dir (0: all; never the one latest names). A
        collective: every rank calls it."""
        blob, refusal = None, None
        if self.rank == 0:  # the other ranks' client_state is not saved, as in DeepSpeed
            try:
                blob = _pack_client_state(client_state, self._module_state(exclude_frozen_parameters)[0],
                                          bool(exclude_frozen_parameters))
            except Exception as e:  # noqa: BLE001 - a pickling error too: refused on every rank, nothing written
                refusal = str(e) if isinstance(e, ValueError) else \
                    f"save_checkpoint: client_state does not save ({type(e).__name__}: {e})"
        self._core.save_checkpoint(os.fspath(save_dir), tag=None if tag is None else str(tag), client_state=blob,
                                   save_latest=save_latest, refusal=refusal, keep_last=int(keep_last))
        return True

    def load_checkpoint(self, load_dir: Union[str, os.PathLike], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple:
        """Loads load_dir/<tag>, or load_dir/latest (or load_dir itself when it is a checkpoint): the
        engine's states, and the model's buffers and frozen parameters saved with them; training resumes
        bit for bit. Returns (the checkpoint's directory, the client_state saved with it, {} if none), as
        DeepSpeed's does, and, as DeepSpeed's, (None, None) with a warning when load_dir holds no
        checkpoint and no tag is given. A corrupt checkpoint, a missing tag, or one saved from another
        model or optimizer raises, and nothing is replaced. load_module_only=True loads the weights (and
        buffers) alone: this engine's optimizer state (moments, step count) stays as it is, fresh on a
        new engine, and the checkpoint's optimizer may differ (fine-tuning). Otherwise the weights,
        optimizer states and schedule come together: the partial flags must keep their defaults."""
        flags = [("load_module_strict", load_module_strict, True), ("custom_load_fn", custom_load_fn is not None, False)]
        if not load_module_only:  # DeepSpeed ignores these with load_module_only
            flags += [("load_optimizer_states", load_optimizer_states, True),
                      ("load_lr_scheduler_states", load_lr_scheduler_states, True)]
        for flag, value, default in flags:
            if bool(value) != default:
                raise ValueError(f"load_checkpoint: {flag}={value} is not supported: a tierzero checkpoint restores "
                                 "the weights, optimizer states and schedule together, into a model whose "
                                 "parameters match it (for the weights alone: load_module_only=True)")
        load_dir = os.fspath(load_dir)
        if tag is None and not any(os.path.exists(os.path.join(load_dir, f)) for f in ("latest", "manifest.json")):
            warnings.warn(f"load_checkpoint: {load_dir} holds no checkpoint (no 'latest' file, no manifest.json); "
                          "nothing was loaded", stacklevel=2)
            return None, None
        tag = None if tag is None else str(tag)
        # The client state is read and checked first (files only), and a refusal goes into the load, so every
        # rank fails before anything is replaced (Note [Client state]).
        blob, refusal, decoded = _core.read_checkpoint_client_state(load_dir, tag), None, {}
        try:
            decoded = _unpack_client_state(blob)
            self._check_module_state(decoded.get("module"), bool(decoded.get("exclude_frozen", False)))
        except ValueError as e:
            refusal = f"load_checkpoint: {e}"
        path, _ = self._core.load_checkpoint(load_dir, tag=tag, weights_only=bool(load_module_only), refusal=refusal,
                                             checked=True, client_state=blob)
        self._restore_module_state(decoded.get("module"))
        self.global_steps = self.optimizer_steps
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()  # checkpoints are at a boundary
        if self.optimizer is not None:
            self.optimizer._show_lr()  # the restored schedule's (or saved) rate for the next step
        return path, decoded.get("client_state", {})

    # Note [State dicts after initialize]
    def _install_state_dict_hooks(self, model: torch.nn.Module) -> None:
        engine_ref = weakref.ref(self)  # as the gathering hooks: no model -> hook -> engine cycle
        self._state_dict_raw = 0

        def fill(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            engine = engine_ref()
            if engine is not None and not engine._state_dict_raw:
                engine._fill_state_dict(module, state_dict, prefix)

        def refuse_load(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
            engine = engine_ref()
            if engine is None or engine._state_dict_raw:
                return
            names = [prefix + key for key, p in module._parameters.items()
                     if p is not None and p in engine._slot and prefix + key in state_dict]
            if names:
                raise ValueError(f"tierzero.torch: load_state_dict() into {names[0]!r} (and {len(names) - 1} more "
                                 "of this module), a parameter whose values live in the engine (its .data is an "
                                 "empty placeholder between forwards): load the weights before initialize(), "
                                 "write them through tierzero.torch.GatheredParameters(params, modifier_rank=0) or "
                                 "safe_set_full_fp32_param, or restore a checkpoint with engine.load_checkpoint")

        for module in model.modules():
            if any(p is not None and p in self._slot for p in module._parameters.values()):
                self._hooks.append(module.register_state_dict_post_hook(fill))
                self._hooks.append(module.register_load_state_dict_pre_hook(refuse_load))

    def _fill_state_dict(self, module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
        """The full values of `module`'s trained parameters in its state_dict (Note [State dicts after
        initialize]). A collective where there are several ranks."""
        slots = [(prefix + key, p) for key, p in module._parameters.items()
                 if p is not None and p in self._slot and p not in self._held_params]
        if not slots:
            return
        if self.closed:
            raise RuntimeError(f"tierzero.torch: state_dict() of a model whose engine is closed: '{slots[0][0]}' "
                               "and the other trained weights were the engine's (save or export them, or "
                               "detach_module(), before close())")
        flats: dict = {}
        for name, p in slots:
            b, i = self._slot[p]
            if b.index not in flats:
                flats[b.index] = torch.from_numpy(self.gather_master(b.index))
            state_dict[name] = flats[b.index].as_strided(*b.views[i]).to(dtype=p.dtype, copy=True)

    @contextlib.contextmanager
    def _raw_state(self) -> Any:
        """The model's state_dict() / load_state_dict() as torch's, placeholders and all (the engine's own reads
        of buffers and frozen parameters, which it does not hold)."""
        self._state_dict_raw += 1
        try:
            yield
        finally:
            self._state_dict_raw -= 1

    def _module_state(self, exclude_frozen: bool) -> tuple:
        """(the model's state_dict() less what the engine holds: buffers and frozen parameters, the names of
        the frozen parameters). Tensors only: a module's non-tensor extra state is its own to save."""
        engine_owned, frozen = set(), set()
        for n, p in self.module.named_parameters(remove_duplicate=False):
            (engine_owned if p in self._slot else frozen).add(n)
        with self._raw_state():
            whole = self.module.state_dict()
        state = {n: t for n, t in whole.items()
                 if isinstance(t, torch.Tensor) and n not in engine_owned and not (exclude_frozen and n in frozen)}
        return state, frozen

    def _check_module_state(self, saved: Optional[dict], exclude_frozen: bool) -> None:
        """As load_state_dict(strict=True) would: the same names (less the frozen parameters when the save
        excluded them), the same shapes."""
        if saved is None:
            return
        have, frozen = self._module_state(exclude_frozen=False)
        unexpected = sorted(set(saved) - set(have))
        missing = sorted(set(have) - set(saved) - (frozen if exclude_frozen else set()))
        wrong = [f"'{n}' {tuple(t.shape)} (the model's: {tuple(have[n].shape)})" for n, t in saved.items()
                 if n in have and t.shape != have[n].shape]
        if unexpected or missing or wrong:
            raise ValueError("the checkpoint's buffers and frozen parameters are not the model's: "
                             + "; ".join(([f"not in the model: {unexpected}"] if unexpected else [])
                                         + ([f"not in the checkpoint: {missing}"] if missing else []) + wrong))

    def _restore_module_state(self, saved: Optional[dict]) -> None:
        if not saved:
            return
        with self._raw_state():
            targets = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in saved.items():
                targets[name].copy_(value)

    def export_safetensors(self, path: Union[str, os.PathLike]) -> None:
        """The fp32 weights as one safetensors file, each tensor under its name in model.state_dict()
        (a tied parameter under its first owner's name); rank 0 writes it."""
        super().export_safetensors(path, [b.names for b in self._blocks])


_STATE_FORMAT = "tierzero.torch checkpoint state 1"


def _load_blob(blob: bytes) -> Any:
    """Note [Client state]: torch.load with weights_only=True (no code from the file runs), tensors on the CPU."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def _pack_client_state(client_state: Optional[dict], module_state: dict, exclude_frozen: bool) -> bytes:
    """Note [Client state]: torch.save's bytes, refused here if _load_blob could not read them back."""
    if client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"save_checkpoint: client_state must be a dict (as DeepSpeed's), not "
                         f"{type(client_state).__name__}")
    buf = io.BytesIO()
    torch.save({"format": _STATE_FORMAT, "client_state": client_state or {}, "module": module_state,
                "exclude_frozen": exclude_frozen}, buf)
    blob = buf.getvalue()
    try:
        _load_blob(blob)
    except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, named in the message
        raise ValueError("save_checkpoint: client_state holds something load_checkpoint could not read back "
                         f"safely (torch.load with weights_only=True: {e}); keep it to tensors, numbers, strings, "
                         "lists, tuples and dicts") from None
    return blob


def _unpack_client_state(blob: Optional[bytes]) -> dict:
    """{"client_state": ..., "module": ...} as _pack_client_state saved them; {} for a checkpoint saved
    without (by the C++ engine or tierzero.Engine, or before tierzero.torch saved any)."""
    if blob is None:
        return {}
    try:
        state = _load_blob(blob)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"the client state was not saved by tierzero.torch (torch.load: {e})") from None
    if isinstance(state, dict) and "format" not in state:
        # The first format (the caller's dict alone): no buffers or frozen parameters to restore.
        warnings.warn("load_checkpoint: this checkpoint holds no buffers or frozen parameters (saved before "
                      "tierzero.torch kept them); the model's own stay", stacklevel=3)
        return {"client_state": state}
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise ValueError(f"the client state was not saved by tierzero.torch (format {state.get('format')!r})"
                         if isinstance(state, dict) else "the client state was not saved by tierzero.torch")
    return state
