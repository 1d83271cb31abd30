"""tierzero.optim with compact states (Note [Compact states in tierzero.optim]): master="remainder" steps bf16
parameters bit for bit as an fp32 master with a bf16 copy-out would; moments="bf16" keeps the moments in bf16;
moments="int8" keeps uint8 codes and block scales; state_dicts round-trip and load torch's; bad combinations
are refused by name."""

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
    with pytest.raises(ValueError, match="moments = 'int4': expected 'fp32', 'bf16' or 'int8'"):
        tzo.AdamW([f32], moments="int4")
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


def _int8_decoded(opt, p, key):
    st = opt.state[p]
    return opt._decode_int8(key, st[key], st[key + "_scale"])


def test_int8_moments_train_as_a_drop_in_adamw_close_to_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    twin = copy.deepcopy(model)
    mine = tzo.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, moments="int8")
    theirs = torch.optim.AdamW(twin.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 4, generator=g)
    losses = []
    for _ in range(150):
        x = torch.randn(64, 32, generator=g)
        for m, opt in ((model, mine), (twin, theirs)):
            loss = torch.nn.functional.mse_loss(m(x), x @ teacher)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if m is model:
                losses.append(loss.item())
    p = next(model.parameters())
    st = mine.state[p]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg"].shape == p.shape
    assert st["exp_avg_sq_scale"].dtype == torch.float32 and st["exp_avg_sq_scale"].numel() == (p.numel() + 255) // 256
    x = torch.randn(256, 32, generator=g)
    with torch.no_grad():
        mine_loss = torch.nn.functional.mse_loss(model(x), x @ teacher).item()
        their_loss = torch.nn.functional.mse_loss(twin(x), x @ teacher).item()
    print(f"int8 AdamW {mine_loss:.4f}, torch AdamW {their_loss:.4f} (first {losses[0]:.4f})")
    assert mine_loss < 0.2 * losses[0]
    assert abs(mine_loss - their_loss) <= 0.1 * their_loss


def test_remainder_and_int8_state_dicts_resume_bit_for_bit_and_load_torch_and_fp32_states():
    master, fp32, bf16, rem, g = _pair(13, moments="int8")
    for _ in range(4):
        _step([(bf16, rem)], g)
    saved = copy.deepcopy(rem.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8 and "exp_avg_sq_scale" in saved["state"][0]
    twin = torch.nn.Parameter(bf16.detach().clone())
    resumed = tzo.AdamW([twin], lr=1e-2, weight_decay=0.1, master="remainder", moments="int8")
    resumed.load_state_dict(saved)
    for _ in range(4):
        grad = (torch.randn(bf16.numel(), generator=g) * 0.1).to(torch.bfloat16)
        for p, opt in ((bf16, rem), (twin, resumed)):
            p.grad = grad
            opt.step()
    assert torch.equal(twin.detach().view(torch.int16), bf16.detach().view(torch.int16))
    for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "master_remainder"):
        assert torch.equal(resumed.state[twin][key], rem.state[bf16][key]), key
    # int8 -> fp32 optimizer: the moments decoded.
    plain = tzo.AdamW([torch.nn.Parameter(bf16.detach().clone())], lr=1e-2, master="remainder")
    plain.load_state_dict(copy.deepcopy(rem.state_dict()))
    q = plain.param_groups[0]["params"][0]
    assert plain.state[q]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in plain.state[q]
    assert torch.equal(plain.state[q]["exp_avg"], _int8_decoded(rem, bf16, "exp_avg"))
    # A torch AdamW's fp32 moments: encoded as the step encodes them (decoding and encoding again is the same).
    p = torch.nn.Parameter(torch.randn(700, generator=g))
    theirs = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(700, generator=g)
    theirs.step()
    mine = tzo.AdamW([p], lr=1e-3, moments="int8")
    mine.load_state_dict(theirs.state_dict())
    st = mine.state[p]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_scale"].numel() == 3
    back = _int8_decoded(mine, p, "exp_avg")
    scale = st["exp_avg_scale"].repeat_interleave(256)[:700]
    err = (back - theirs.state[p]["exp_avg"]).abs()
    assert (err <= 0.05 * scale).all()  # within the code's top-decade spacing of each block's scale
    assert st["exp_avg_scale"][0] == theirs.state[p]["exp_avg"][:256].abs().max()
