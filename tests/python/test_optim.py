"""tierzero.optim (bindings/tierzero/optim.py): torch.optim optimizers on tierzero's kernels, against torch's."""

import copy

import pytest
import torch

import tierzero.optim as tzo

# fp32 rounding: the kernels and torch's CPU AdamW compute the same formula in
# fp32 with a different operation order (FMA, bias corrections in double), so
# after 20 steps parameters of magnitude ~1 agree to a few ulps times the step
# count. 2e-6 absolute is ~17 ulps at 1.0.
TOL = 2e-6


def random_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))


def groups(m):
    """Two param groups, the second with its own lr and no weight decay."""
    return [{"params": list(m[0].parameters()) + list(m[2].parameters())},
            {"params": list(m[3].parameters()) + list(m[5].parameters()), "lr": 3e-3, "weight_decay": 0.0}]


def train_pair(make_ours, make_theirs, steps=20, seed=0):
    """Trains two copies of a random model on the same data; returns the largest |param difference|."""
    a = random_model(seed)
    b = copy.deepcopy(a)
    opt_a, opt_b = make_ours(groups(a)), make_theirs(groups(b))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x, y = torch.randn(16, 37, generator=gen), torch.randn(16, 5, generator=gen)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters())), a, b, opt_a, opt_b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adamw_matches_torch_for_20_steps(seed):
    err, *_ = train_pair(lambda g: tzo.AdamW(g, lr=1e-2, weight_decay=0.05),
                         lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05), seed=seed)
    print(f"AdamW seed {seed}: largest |tierzero - torch.optim.AdamW| after 20 steps = {err:.3g} (tolerance {TOL})")
    assert err <= TOL


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_matches_torch(amsgrad):
    err, *_ = train_pair(lambda g: tzo.Adam(g, lr=1e-2, weight_decay=0.01, amsgrad=amsgrad),
                         lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.01, amsgrad=amsgrad))
    print(f"Adam amsgrad={amsgrad}: largest error {err:.3g}")
    assert err <= TOL


def test_adagrad_matches_torch():
    err, *_ = train_pair(lambda g: tzo.Adagrad(g, lr=1e-2, lr_decay=1e-3, weight_decay=0.01,
                                               initial_accumulator_value=0.1),
                         lambda g: torch.optim.Adagrad(g, lr=1e-2, lr_decay=1e-3, weight_decay=0.01,
                                                       initial_accumulator_value=0.1))
    print(f"Adagrad: largest error {err:.3g}")
    assert err <= TOL


class TorchLion(torch.optim.Optimizer):
    """Lion in plain torch (Chen et al., 2023), as the reference."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(b1 * m + (1 - b1) * p.grad), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def test_lion_matches_a_torch_reference():
    err, *_ = train_pair(lambda g: tzo.Lion(g, lr=1e-3, weight_decay=0.1),
                         lambda g: TorchLion(g, lr=1e-3, weight_decay=0.1))
    print(f"Lion: largest error {err:.3g}")
    assert err <= TOL


def test_state_dict_round_trips_and_moves_between_tierzero_and_torch():
    _, a, b, opt_a, opt_b = train_pair(lambda g: tzo.AdamW(g, lr=1e-2), lambda g: torch.optim.AdamW(g, lr=1e-2),
                                       steps=5)
    sd = opt_a.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and sd["state"][0]["step"].item() == 5
    # ours -> torch and torch -> ours: the states mean the same thing
    torch_opt = torch.optim.AdamW(groups(a), lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    ours = tzo.AdamW(groups(b), lr=1e-2)
    ours.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    assert ours.param_groups[1]["lr"] == 3e-3
    x, y = torch.randn(4, 37), torch.randn(4, 5)
    for model, opt in ((a, torch_opt), (b, ours)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    err = max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
    assert err <= TOL


def test_step_with_closure_returns_the_loss_and_zero_grad_clears():
    model = random_model(3)
    opt = tzo.AdamW(model.parameters())
    x, y = torch.randn(4, 37), torch.randn(4, 5)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_params_without_grad_are_skipped():
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = tzo.AdamW([p, q])
    p.grad = torch.ones(4)
    opt.step()
    assert (p < 1).all() and torch.equal(q, torch.ones(4)) and len(opt.state) == 1


def test_param16_copy_out():
    p = torch.nn.Parameter(torch.randn(1000))
    opt = tzo.AdamW([p], param16_dtype=torch.bfloat16)
    p.grad = torch.randn(1000)
    opt.step()
    assert torch.equal(opt.param16(p), p.detach().to(torch.bfloat16))
    assert "param16" not in opt.state_dict()["state"][0]
    with pytest.raises(RuntimeError, match="param16_dtype"):
        tzo.AdamW([p]).param16(p)


def test_a_refused_step_leaves_the_state_as_it_was():
    torch.manual_seed(4)
    p, q = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(3, 2))
    opt = tzo.AdamW([p, q], lr=1e-2)
    p.grad, q.grad = torch.randn(6), torch.randn(3, 2)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[q].items()}
    q_before = q.detach().clone()
    q.grad = torch.randn(2, 3).t()  # not contiguous: the kernel refuses it
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\]\.grad is a torch.float32 tensor"):
        opt.step()
    assert all(torch.equal(opt.state[q][k], v) for k, v in before.items()) and torch.equal(q.detach(), q_before)
    assert opt.state[q]["step"].item() == 1
    q.grad = None
    fresh = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    fresh.grad = torch.ones(4, dtype=torch.float64)
    opt.add_param_group({"params": [fresh]})
    p.grad = torch.randn(6)
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\] is a torch.float64 tensor"):
        opt.step()
    assert len(opt.state[fresh]) == 0  # no state for a parameter never stepped
    # Parameters before the refused one in the same step() did step (each is refused or stepped on its own).
    assert opt.state[p]["step"].item() == 3


def test_step_counters_continue_from_a_loaded_state_dict():
    torch.manual_seed(6)
    p = torch.nn.Parameter(torch.randn(8))
    opt = tzo.Adam([p], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(8)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["step"].item() == 3
    sd["state"][0]["step"] = 7  # a plain number, as some checkpoints have it
    opt.load_state_dict(sd)
    assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].item() == 7
    p.grad = torch.randn(8)
    opt.step()
    assert opt.state[p]["step"].item() == 8 and opt.state_dict()["state"][0]["step"].item() == 8


def test_unsupported_params_and_options_are_refused_by_name():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"AdamW: param_groups\[0\]\['params'\]\[0\] is a torch.float64 tensor"):
        tzo.AdamW([p]).step()
    q = torch.nn.Parameter(torch.ones(4, 4))
    q.grad = torch.ones(4, 4).t()
    with pytest.raises(TypeError, match=r"\.grad is a torch.float32 tensor on cpu; expected a contiguous"):
        tzo.Adam([q]).step()
    r = torch.nn.Parameter(torch.ones(4))
    r.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"\['maximize'\] = True is not supported"):
        tzo.AdamW([r], maximize=True).step()
    with pytest.raises(TypeError, match="param16_dtype"):
        tzo.AdamW([r], param16_dtype=torch.float64)


# Note [Coloured state]: states of 32 MiB and more start their colour's 68 KiB step past the parameter,
# modulo 2 MiB, so the streams of one kernel never alias; the step's result does not depend on it.
@pytest.mark.parametrize("make", [lambda ps: tzo.AdamW(ps, lr=1e-3, amsgrad=True, param16_dtype=torch.bfloat16),
                                  lambda ps: tzo.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
                                  lambda ps: tzo.Lion(ps, lr=1e-4)])
def test_large_states_are_coloured_apart_from_the_parameter_and_each_other(make, monkeypatch):
    huge = 2 << 20
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(3, (8 << 20) // 3 + 1))  # 32 MiB + 4 bytes: coloured
    small = torch.nn.Parameter(torch.randn(1000))               # left as torch allocates it
    twin_big, twin_small = (torch.nn.Parameter(t.detach().clone()) for t in (big, small))
    for p in (big, small, twin_big, twin_small):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    opt = make([big, small])
    opt.step()
    arrays = [t for t in opt.state[big].values() if t.dim() > 0]
    if getattr(opt, "_param16", None) and big in opt._param16:
        arrays.append(opt._param16[big])
    assert arrays, "no state to check"
    residues = [big.data_ptr() % huge] + [t.data_ptr() % huge for t in arrays]
    assert len(set(residues)) == len(residues), f"streams alias modulo 2 MiB: {residues}"
    for t in arrays:
        assert t.is_contiguous() and t.shape == big.shape
        assert (t.data_ptr() - big.data_ptr()) % huge in {c * (68 << 10) for c in (2, 3, 4, 6)}
    # The same step with every state placed as torch allocates it: bit for bit the same parameters and states.
    monkeypatch.setattr(tzo, "_COLOUR_MIN_BYTES", 1 << 62)
    ref = make([twin_big, twin_small])
    ref.step()
    assert torch.equal(big.detach(), twin_big.detach()) and torch.equal(small.detach(), twin_small.detach())
    for key, value in opt.state[big].items():
        assert torch.equal(value, ref.state[twin_big][key]), key
