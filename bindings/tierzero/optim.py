"""tierzero.optim: torch.optim optimizers stepped by tierzero's SIMD CPU kernels.

    opt = tierzero.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loss.backward(); opt.step(); opt.zero_grad()

Adam, AdamW, Adagrad and Lion subclass torch.optim.Optimizer: param groups,
state_dict / load_state_dict (the same state keys as torch's Adam, AdamW and
Adagrad, so a state dict moves between the two), step(closure), zero_grad.
Each step calls the C++ kernel once per parameter on the parameter's own
storage and its state tensors, zero-copy through DLPack, with the GIL
released: one fused pass reads and writes each byte of state once
(tierzero/cpu_adam.h has the formulas; they follow torch.optim).

Parameters must be float32, contiguous CPU tensors (the master weights);
gradients float32, bfloat16 or float16; state tensors are float32 CPU
tensors. Anything else is refused with a message naming the parameter
(param_groups[g]['params'][i]). maximize, capturable, differentiable and
sparse gradients are not supported (refused).

Note [Per-parameter cost]
A step is one kernel call per parameter, and with small tensors the Python
around the call is most of the time (bench/RESULTS.md: torch's fused AdamW
takes a whole group in one call). So the per-parameter path does only what
it must: arrays go as DLPack capsules (Note [Capsules, not tensors] in
torch/hooks.py); the checks that name a parameter run only when the kernel or
the export refuses it (the kernel checks dtype, device, order and size itself);
the step counter, a 0-d float32 tensor in the state as torch keeps it, is
read and written through a cached numpy view of it (a tensor += 1 and .item()
cost ~2.3 us, the view ~0.1 us), and only after the kernel ran, so a refused
parameter's state is left as it was (parameters before it in the same step()
have stepped: each is stepped or refused on its own, as before).

Note [Compact states in tierzero.optim]
master="remainder" (Adam, AdamW, Adagrad, Lion) steps bf16 parameters as if
each had an fp32 master weight, bit for bit, storing 2.125 B a parameter
instead of 4 (Note [Remainder masters] in cpu_adam/src/remainder.h): the
parameters are the model's contiguous bfloat16 CPU tensors, updated in place
to the round-to-nearest-even of the master, and state["master_remainder"]
(uint8, 2n + ceil(n / 8) bytes: n int16 remainders, then n tie bits) holds
what the bf16 value lacks. A new state starts at zero remainder: the master
is the bf16 parameter exactly, as torch's optimizers over bf16 parameters
have it, so such a state_dict loads as that. moments="bf16" keeps exp_avg and
exp_avg_sq (Adagrad's sum) in bfloat16 (4 B a parameter instead of 8):
exp_avg rounded to nearest even, exp_avg_sq by stochastic rounding keyed by
the parameter's place in param_groups, as state_dict numbers it (Note
[Stochastic rounding of bf16 second moments] in tierzero/cpu_adam.h: rounded
to nearest, a second moment with betas[1] = 0.999 stops decaying); "fp32" is
torch's. load_state_dict keeps
these dtypes (torch would cast every state to the parameter's dtype: a
remainder to bf16) and converts moments of the other width.
moments="int8" keeps each moment (exp_avg, exp_avg_sq, Adagrad's sum) as
uint8 codes shaped as the parameter plus state["<key>_scale"], float32, one
scale per 256 elements (2.03 B a parameter for two moments; Note [Int8
moments] in cpu_adam/src/int8_codes.h). state_dict holds the codes and
scales as they are; load_state_dict keeps them, encodes float moments (a
torch or fp32/bf16 state dict) as the step would, and decodes saved int8
moments into an fp32 or bf16 optimizer.

param16_dtype=torch.bfloat16 (or float16) adds the fused 16-bit copy-out:
the same pass writes each new parameter rounded to 16 bits into a separate
tensor, `optimizer.param16(p)`, for a mixed-precision model to run on. It is
derived state: not in state_dict, rebuilt by the next step.

Note [Coloured state]
The kernel streams the parameter, its gradient, its states and the 16-bit
copy together. Arrays an exact multiple of a large power of two apart share
cache sets (Note [Coloured arrays] in tierzero/offload/pool.h: ~2x slower
Adam on an AVX2 host with its arrays 128 MiB apart), and torch allocates
large tensors as adjacent mappings their sizes apart. So every array of a
parameter of 32 MiB or more is placed in a buffer 2 MiB larger, at the
offset that puts it colour x 68 KiB past the parameter modulo 2 MiB
(exp_avg 2, exp_avg_sq or sum 3, the 16-bit copy 4, max_exp_avg_sq 6): at
most 7 % more state memory, at the smallest. It is
a contiguous view: state_dict saves it as any tensor; a state loaded by
load_state_dict keeps the placement it was loaded with.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Optional

import torch
from torch.utils.dlpack import to_dlpack

from . import _core

__all__ = ["Adam", "AdamW", "Adagrad", "Lion"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Note [Coloured state]: the colours of tierzero/offload/pool.h's Colour, the parameter being the master (0).
_COLOURS = {"exp_avg": 2, "exp_avg_sq": 3, "sum": 3, "param16": 4, "max_exp_avg_sq": 6}
_COLOUR_STEP_BYTES = 68 << 10
_HUGE_PAGE_BYTES = 2 << 20
_COLOUR_MIN_BYTES = 32 << 20


def _coloured_like(p: torch.Tensor, colour: int, make: Callable[..., torch.Tensor],
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A contiguous CPU tensor shaped as p (make = torch.zeros or torch.empty), placed by colour when large."""
    dtype = p.dtype if dtype is None else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = p.numel()
    if n * p.element_size() < _COLOUR_MIN_BYTES or p.device.type != "cpu":  # by the parameter: all its streams
        return make(p.shape, dtype=dtype, device=p.device)
    pad = _HUGE_PAGE_BYTES // itemsize
    buf = make(n + pad, dtype=dtype)
    want = (p.data_ptr() + colour * _COLOUR_STEP_BYTES) % _HUGE_PAGE_BYTES
    shift = (want - buf.data_ptr()) % _HUGE_PAGE_BYTES
    if shift % itemsize:  # an odd parameter address: no placement lines up, take the start
        shift = 0
    start = shift // itemsize
    return buf[start:start + n].view(p.shape)
_UNSUPPORTED_TRUE = ("maximize", "capturable", "differentiable")


class _CpuOptimizer(torch.optim.Optimizer):
    """Common machinery: validation, state, and the per-parameter kernel call."""

    _algorithm: ClassVar[Any]
    _state_keys: ClassVar[tuple[str, ...]]
    _optional_state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Iterable[Any], defaults: dict, *, threads: int = 0,
                 param16_dtype: Optional[torch.dtype] = None, master: str = "fp32", moments: str = "fp32"):
        if param16_dtype not in (None, torch.bfloat16, torch.float16):
            raise TypeError(f"param16_dtype = {param16_dtype}: expected None, torch.bfloat16 or torch.float16")
        if master not in ("fp32", "remainder"):
            raise ValueError(f"master = {master!r}: expected 'fp32' or 'remainder'")
        if moments not in ("fp32", "bf16", "int8"):
            raise ValueError(f"moments = {moments!r}: expected 'fp32', 'bf16' or 'int8'")
        if master == "remainder" and param16_dtype is not None:
            raise ValueError("param16_dtype with master='remainder': the bfloat16 parameters are the 16-bit copy, "
                             "updated in place; there is no other")
        self._remainder = master == "remainder"
        self._int8 = moments == "int8"
        self._moment_dtype = {"bf16": torch.bfloat16, "int8": torch.uint8}.get(moments, torch.float32)
        super().__init__(params, defaults)
        self._kernel = _core.CpuOptimizer(threads=threads)
        self._param16_dtype = param16_dtype
        self._param16: dict[torch.Tensor, torch.Tensor] = {}
        self._counters: dict[torch.Tensor, tuple] = {}  # p -> (state["step"], a numpy view of it)

    @property
    def simd(self) -> str:
        """The SIMD variant the kernels run ("avx512", "avx2", ...)."""
        return self._kernel.simd

    def param16(self, p: torch.Tensor) -> torch.Tensor:
        """The 16-bit copy of p written by the last step (param16_dtype must be set)."""
        if self._param16_dtype is None:
            raise RuntimeError("param16(): construct the optimizer with param16_dtype=torch.bfloat16 or float16")
        if p not in self._param16:
            raise KeyError("param16(): this parameter has not been stepped yet")
        return self._param16[p]

    def _name(self, g: int, i: int) -> str:
        return f"{type(self).__name__}: param_groups[{g}]['params'][{i}]"

    def _check(self, p: torch.Tensor, g: int, i: int) -> None:
        want = torch.bfloat16 if self._remainder else torch.float32
        if p.device.type != "cpu" or p.dtype != want or not p.is_contiguous():
            kind = "master='remainder' steps contiguous bfloat16" if self._remainder else \
                "the CPU optimizer steps contiguous float32"
            raise TypeError(f"{self._name(g, i)} is a {'' if p.is_contiguous() else 'non-contiguous '}{p.dtype} "
                            f"tensor on {p.device}; {kind} CPU tensors")
        grad = p.grad
        if grad.is_sparse:
            raise TypeError(f"{self._name(g, i)} has a sparse gradient; sparse gradients are not supported")
        if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPES or not grad.is_contiguous():
            raise TypeError(f"{self._name(g, i)}.grad is a {grad.dtype} tensor on {grad.device}; expected a "
                            "contiguous float32, bfloat16 or float16 CPU tensor")
        if grad.shape != p.shape:
            raise ValueError(f"{self._name(g, i)}.grad has shape {tuple(grad.shape)}; the parameter has "
                             f"{tuple(p.shape)}")

    def _check_group(self, group: dict, g: int) -> None:
        for key in _UNSUPPORTED_TRUE:
            if group.get(key, False):
                raise ValueError(f"{type(self).__name__}: param_groups[{g}]['{key}'] = True is not supported")

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        state["step"] = torch.tensor(0.0)
        for key in self._state_keys:
            state[key] = _coloured_like(p, _COLOURS[key], torch.zeros, self._moment_dtype)
            if self._int8:  # zero codes and scales: zero moments
                state[key + "_scale"] = torch.zeros(self._int8_blocks(p.numel()), dtype=torch.float32)
        if self._remainder:
            state["master_remainder"] = self._zero_remainder(p)

    # The kernel's argument for each moment state key (Adagrad's sum is its exp_avg_sq).
    _kernel_args: ClassVar[dict] = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "sum": "exp_avg_sq"}

    @staticmethod
    def _int8_blocks(n: int) -> int:
        return (n + 255) // 256

    def _encode_int8(self, key: str, value: torch.Tensor, shape: torch.Size) -> tuple:
        """A float moment as (uint8 codes shaped `shape`, float32 block scales), as the step encodes."""
        x = value.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1).clone()
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        scales = torch.empty(self._int8_blocks(x.numel()), dtype=torch.float32)
        _core.int8_moment(self._kernel_args[key], x, codes, scales, True)
        return codes.view(shape), scales

    def _decode_int8(self, key: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Int8 codes and scales as a float32 moment shaped as the codes."""
        c = codes.detach().to("cpu").contiguous()
        x = torch.empty(c.shape, dtype=torch.float32)
        _core.int8_moment(self._kernel_args[key], x, c.view(-1), scales.detach().to("cpu", torch.float32).contiguous(),
                          False)
        return x

    @staticmethod
    def _remainder_bytes(n: int) -> int:
        """A remainder master's bytes for n elements: n int16 remainders, then ceil(n / 8) tie-bit bytes."""
        return 2 * n + (n + 7) // 8

    @staticmethod
    def _zero_remainder(p: torch.Tensor) -> torch.Tensor:
        """The remainder of a master equal to the bf16 parameter: all zero (Note [Compact states in tierzero.optim])."""
        return torch.zeros(_CpuOptimizer._remainder_bytes(p.numel()), dtype=torch.uint8)

    def _saved_params(self, state_dict: dict) -> list:
        """(saved index, parameter) pairs, matched in order as torch's load_state_dict matches them."""
        saved_ids = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
        return list(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))

    def _state_arrays(self, state: dict, group: dict) -> dict:
        raise NotImplementedError

    def _hyper(self, group: dict) -> Any:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step for every parameter with a gradient. Returns closure()'s loss when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        key = 0  # the parameter's index in state_dict's numbering: its stochastic-rounding key
        for g, group in enumerate(self.param_groups):
            self._check_group(group, g)
            hyper = self._hyper(group)
            for i, p in enumerate(group["params"]):
                key += 1
                if p.grad is None:
                    continue
                try:
                    self._step_param(p, group, hyper, key - 1)
                except (TypeError, ValueError, RuntimeError, BufferError):
                    try:
                        self._check(p, g, i)
                    except (TypeError, ValueError) as named:  # the same refusal, naming the parameter
                        raise named from None
                    raise
        return loss

    def _step_param(self, p: torch.Tensor, group: dict, hyper: Any, key: int) -> None:
        """One parameter's step (Note [Per-parameter cost])."""
        grad = p.grad
        if grad.shape != p.shape:
            raise ValueError("gradient shape")  # _check names it
        state = self.state[p]
        fresh = len(state) == 0
        if fresh:
            self._init_state(p, state, group)
        step = state["step"]
        counter = self._counters.get(p)
        if counter is None or counter[0] is not step:  # new, or replaced (load_state_dict, by hand)
            counter = self._counters[p] = (step, step.numpy())
        n = int(counter[1]) + 1
        param16 = None
        if self._param16_dtype is not None:
            param16 = self._param16.get(p)
            if param16 is None:
                param16 = self._param16[p] = _coloured_like(p, _COLOURS["param16"], torch.empty, self._param16_dtype)
        try:
            # p.detach(): the same storage (torch refuses to export a tensor that requires grad).
            arrays = self._state_arrays(state, group)
            states = {k: to_dlpack(v) for k, v in arrays.items()}
            if self._int8:
                for name in self._state_keys:
                    states[self._kernel_args[name] + "_scale"] = to_dlpack(state[name + "_scale"])
            remainder = to_dlpack(state["master_remainder"]) if self._remainder else None
            self._kernel.step(hyper, n, 1.0, to_dlpack(p.detach()), to_dlpack(grad),
                              param16=None if param16 is None else to_dlpack(param16), remainder=remainder,
                              rounding_key=key, **states)
        except BaseException:
            if fresh:
                state.clear()  # a refused parameter keeps no state
            raise
        counter[1][...] = n  # state["step"] += 1, once the step is done

    def _refuse_foreign(self, state_dict: dict) -> None:
        """Another optimizer's state_dict (a torch Adagrad's into AdamW, an AdamW's into Lion) is refused by
        name before anything is loaded: its groups lack hyperparameters this one needs, or its states hold
        other moments."""
        name = type(self).__name__
        for g, group in enumerate(state_dict.get("param_groups", [])):
            missing = sorted(set(self.defaults) - set(group))
            if missing:
                raise ValueError(f"{name}.load_state_dict: param_groups[{g}] has no {missing}: the state_dict is "
                                 "another optimizer's")
        allowed = {"step", *self._state_keys, *self._optional_state_keys, *(k + "_scale" for k in self._state_keys)}
        if self._remainder:
            allowed.add("master_remainder")
        for index, state in state_dict.get("state", {}).items():
            keys = set(state)
            if keys and (keys - allowed or not set(self._state_keys) <= keys):
                raise ValueError(f"{name}.load_state_dict: state[{index}] holds {sorted(keys)}; {name} keeps "
                                 f"{sorted({'step', *self._state_keys})}: the state_dict is another optimizer's")

    def load_state_dict(self, state_dict: dict) -> None:
        self._refuse_foreign(state_dict)
        if self._remainder:
            self._check_remainders(state_dict)
        super().load_state_dict(state_dict)
        self._restore_state_dtypes(state_dict)
        # torch casts floating state to the parameter's dtype and device; the
        # kernels also need contiguous memory.
        for state in self.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and not value.is_contiguous():
                    state[key] = value.contiguous()
            step = state.get("step")
            if step is not None and not (isinstance(step, torch.Tensor) and step.device.type == "cpu"
                                         and step.dtype == torch.float32 and step.dim() == 0):
                # A number, or a tensor on a GPU (torch's fused/capturable optimizers): the counter is a
                # 0-d float32 CPU tensor here (Note [Per-parameter cost]).
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        self._param16.clear()
        self._counters.clear()

    def _check_remainders(self, state_dict: dict) -> None:
        """Each saved remainder fits its parameter, before anything is loaded."""
        for index, p in self._saved_params(state_dict):
            r = state_dict.get("state", {}).get(index, {}).get("master_remainder")
            n, want = p.numel(), self._remainder_bytes(p.numel())
            if r is not None and (not isinstance(r, torch.Tensor) or r.dtype != torch.uint8 or r.numel() != want):
                what = f"a {r.dtype} tensor of {r.numel()} elements" if isinstance(r, torch.Tensor) else type(r)
                raise ValueError(f"{type(self).__name__}.load_state_dict: state[{index}]['master_remainder'] is "
                                 f"{what}; a parameter of {n} elements needs uint8 x {want}")

    def _restore_state_dtypes(self, state_dict: dict) -> None:
        """Undoes torch's cast of every state to the parameter's dtype (Note [Compact states in tierzero.optim]):
        each state is taken again from the saved one, moments converted to this optimizer's dtype, a remainder
        as saved (none: zero, the master being the bf16 parameter)."""
        saved = state_dict.get("state", {})
        moment_keys = set(self._state_keys)
        for index, p in self._saved_params(state_dict):
            state = self.state.get(p)
            original = saved.get(index)
            if not state or original is None:
                continue
            for key, value in original.items():
                if key == "step" or not isinstance(value, torch.Tensor) or key.endswith("_scale"):
                    continue
                if key in moment_keys:
                    saved_int8 = key + "_scale" in original and value.dtype == torch.uint8
                    if saved_int8 and self._int8:  # as saved
                        state[key] = value.detach().to("cpu").contiguous().clone()
                        state[key + "_scale"] = original[key + "_scale"].detach().to("cpu", torch.float32).clone()
                        continue
                    if saved_int8:
                        value = self._decode_int8(key, value, original[key + "_scale"])
                    if self._int8:
                        state[key], state[key + "_scale"] = self._encode_int8(key, value, p.shape)
                        continue
                dtype = self._moment_dtype if key in moment_keys else torch.uint8 if key == "master_remainder" \
                    else torch.float32
                state[key] = value.detach().to(device="cpu", dtype=dtype).contiguous().clone()
            for key in list(state):
                if key.endswith("_scale") and not self._int8:
                    del state[key]
            if self._remainder and "master_remainder" not in original:
                state["master_remainder"] = self._zero_remainder(p)


class Adam(_CpuOptimizer):
    """torch.optim.Adam on tierzero's SIMD kernels (L2 weight decay added to the gradient; amsgrad supported)."""

    _algorithm = _core.Algorithm.Adam
    _state_keys = ("exp_avg", "exp_avg_sq")
    _optional_state_keys = ("max_exp_avg_sq",)  # amsgrad

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 threads: int = 0, param16_dtype: Optional[torch.dtype] = None, master: str = "fp32",
                 moments: str = "fp32"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, threads=threads, param16_dtype=param16_dtype, master=master,
                         moments=moments)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        super()._init_state(p, state, group)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = _coloured_like(p, _COLOURS["max_exp_avg_sq"], torch.zeros, torch.float32)

    def _state_arrays(self, state: dict, group: dict) -> dict:
        out = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        if group["amsgrad"]:
            if "max_exp_avg_sq" not in state:  # amsgrad switched on after the first step
                state["max_exp_avg_sq"] = (self._decode_int8("exp_avg_sq", state["exp_avg_sq"], state["exp_avg_sq_scale"])
                                           if self._int8 else state["exp_avg_sq"].to(torch.float32, copy=True))
            out["max_exp_avg_sq"] = state["max_exp_avg_sq"]
        return out

    def _hyper(self, group: dict) -> Any:
        beta1, beta2 = group["betas"]
        return _core.Hyper(algorithm=self._algorithm, lr=float(group["lr"]), beta1=float(beta1),
                           beta2=float(beta2), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                           amsgrad=bool(group["amsgrad"]))


class AdamW(Adam):
    """torch.optim.AdamW on tierzero's SIMD kernels (decoupled weight decay, default 0.01 as torch's)."""

    _algorithm = _core.Algorithm.AdamW

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 threads: int = 0, param16_dtype: Optional[torch.dtype] = None, master: str = "fp32",
                 moments: str = "fp32"):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, threads=threads,
                         param16_dtype=param16_dtype, master=master, moments=moments)


class Adagrad(_CpuOptimizer):
    """torch.optim.Adagrad on tierzero's SIMD kernels (state 'sum', lr_decay, initial_accumulator_value)."""

    _algorithm = _core.Algorithm.Adagrad
    _state_keys = ("sum",)

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False,
                 threads: int = 0, param16_dtype: Optional[torch.dtype] = None, master: str = "fp32",
                 moments: str = "fp32"):
        if not initial_accumulator_value >= 0:  # a negative sum of squares has no square root
            raise ValueError(f"Adagrad: initial_accumulator_value = {initial_accumulator_value} must be >= 0")
        if not lr_decay >= 0:
            raise ValueError(f"Adagrad: lr_decay = {lr_decay} must be >= 0")
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize)
        super().__init__(params, defaults, threads=threads, param16_dtype=param16_dtype, master=master,
                         moments=moments)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        state["step"] = torch.tensor(0.0)
        state["sum"] = _coloured_like(p, _COLOURS["sum"], torch.empty)
        state["sum"].fill_(float(group["initial_accumulator_value"]))
        if self._int8:
            state["sum"], state["sum_scale"] = self._encode_int8("sum", state["sum"], p.shape)

    def _state_arrays(self, state: dict, group: dict) -> dict:
        return {"exp_avg_sq": state["sum"]}

    def _hyper(self, group: dict) -> Any:
        return _core.Hyper(algorithm=self._algorithm, lr=float(group["lr"]), eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"]), lr_decay=float(group["lr_decay"]))


class Lion(_CpuOptimizer):
    """Lion (Chen et al., 2023): p *= 1 - lr*wd; p -= lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g."""

    _algorithm = _core.Algorithm.Lion
    _state_keys = ("exp_avg",)

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, threads: int = 0, param16_dtype: Optional[torch.dtype] = None,
                 master: str = "fp32", moments: str = "fp32"):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, threads=threads, param16_dtype=param16_dtype, master=master,
                         moments=moments)

    def _state_arrays(self, state: dict, group: dict) -> dict:
        return {"exp_avg": state["exp_avg"]}

    def _hyper(self, group: dict) -> Any:
        beta1, beta2 = group["betas"]
        return _core.Hyper(algorithm=self._algorithm, lr=float(group["lr"]), beta1=float(beta1),
                           beta2=float(beta2), weight_decay=float(group["weight_decay"]))
