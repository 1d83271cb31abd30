"""tierzero.optim with compact states (Note [Compact states in tierzero.optim]): master="remainder" steps bf16
parameters bit for bit as an fp32 master with a bf16 copy-out would; moments="bf16" keeps the moments in bf16;
state_dicts round-trip and load torch's; bad combinations are refused by name."""

import copy

import numpy as np
import pytest
import torch

import tierzero.optim as tzo


def _decode(param: torch.Tensor, remainder: torch.Tensor) -> np.ndarray:
    """The fp32 master as bits: (h << 16) + sext(r) + (t ? 0x10000 : 0), mod 2^32 (tierzero/cpu_adam.h)."""
    n = param.numel()
    h = param.detach().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    raw = remainder.numpy()
    r = raw[:2 * n].view(np.int16).astype(np.int64)
    t = (np.unpackbits(raw[2 * n:], bitorder="little")[:n]).astype(np.int64)
    return ((h << 16) + r + (t << 16)) & 0xFFFFFFFF


def _pair(seed: int, n: int = 3000, **kwargs):
    """The same bf16 weights as fp32 masters with a bf16 copy-out, and as bf16 parameters with remainders."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=g).to(torch.bfloat16)
    master = torch.nn.Parameter(start.float())
    bf16 = torch.nn.Parameter(start.clone())
    fp32 = tzo.AdamW([master], lr=1e-2, weight_decay=0.1, param16_dtype=torch.bfloat16, **kwargs)
    rem = tzo.AdamW([bf16], lr=1e-2, weight_decay=0.1, master="remainder", **kwargs)
    return master, fp32, bf16, rem, g


def _step(params_and_opts, g: torch.Generator):
    # Mixed precision's gradients are 16-bit: both optimizers see the same bf16 values.
    grad = (torch.randn(params_and_opts[0][0].numel(), generator=g) * 0.1).to(torch.bfloat16)
    for p, opt in params_and_opts:
        p.grad = grad.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_remainder_masters_step_bit_for_bit_as_fp32_masters(moments):
    master, fp32, bf16, rem, g = _pair(7, moments=moments)
    for _ in range(20):
        _step([(master, fp32), (bf16, rem)], g)
        assert torch.equal(bf16.detach().view(torch.int16), fp32.param16(master).view(torch.int16))
        want = master.detach().view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
        assert np.array_equal(_decode(bf16, rem.state[bf16]["master_remainder"]), want)
    assert rem.state[bf16]["exp_avg"].dtype == (torch.bfloat16 if moments == "bf16" else torch.float32)
    # The remainders carry what bf16 lacks (an all-zero remainder would be bf16-only training).
    assert (rem.state[bf16]["master_remainder"][:2 * bf16.numel()] != 0).any()


def test_a_remainder_state_dict_resumes_bit_for_bit():
    master, fp32, bf16, rem, g = _pair(11)
    for _ in range(5):
        _step([(master, fp32), (bf16, rem)], g)
    saved = copy.deepcopy(rem.state_dict())  # as torch.save / torch.load would give it
    twin = torch.nn.Parameter(bf16.detach().clone())
    resumed = tzo.AdamW([twin], lr=1e-2, weight_decay=0.1, master="remainder")
    resumed.load_state_dict(saved)
    assert resumed.state[twin]["master_remainder"].dtype == torch.uint8
    assert resumed.state[twin]["exp_avg"].dtype == torch.float32  # not cast to the bf16 parameter's dtype
    for _ in range(5):
        grad = torch.randn(bf16.numel(), generator=g) * 0.1
        for p, opt in ((bf16, rem), (twin, resumed)):
            p.grad = grad.to(torch.bfloat16)
            opt.step()
    assert torch.equal(twin.detach().view(torch.int16), bf16.detach().view(torch.int16))
    assert torch.equal(resumed.state[twin]["master_remainder"], rem.state[bf16]["master_remainder"])


def test_a_torch_adamw_state_over_bf16_params_loads_as_a_zero_remainder():
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(500, generator=g).to(torch.bfloat16))
    theirs = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(500, generator=g).to(torch.bfloat16)
    theirs.step()
    mine = tzo.AdamW([p], lr=1e-3, master="remainder")
    mine.load_state_dict(theirs.state_dict())
    state = mine.state[p]
    assert torch.count_nonzero(state["master_remainder"]) == 0  # the master is the bf16 parameter, as torch has it
    assert state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], theirs.state[p]["exp_avg"].float())


def test_bad_compact_state_combinations_are_refused_by_name():
    f32 = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ValueError, match="moments = 'int8': expected 'fp32' or 'bf16' \\('int8' is not implemented"):
        tzo.AdamW([f32], moments="int8")
    with pytest.raises(ValueError, match="master = 'fp16'"):
        tzo.AdamW([f32], master="fp16")
    with pytest.raises(ValueError, match="param16_dtype with master='remainder'"):
        tzo.AdamW([f32], master="remainder", param16_dtype=torch.bfloat16)
    opt = tzo.AdamW([f32], master="remainder")
    f32.grad = torch.zeros(10)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\] is a torch.float32 tensor on cpu; "
                                        "master='remainder' steps contiguous bfloat16 CPU tensors"):
        opt.step()
    b = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    good = tzo.AdamW([b], master="remainder")
    bad = good.state_dict()
    bad["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10),
                        "master_remainder": torch.zeros(7, dtype=torch.uint8)}}
    with pytest.raises(ValueError, match=r"state\[0\]\['master_remainder'\] is a torch.uint8 tensor of 7 elements; "
                                         "a parameter of 10 elements needs uint8 x 22"):
        good.load_state_dict(bad)
