"""tierzero.torch.initialize on a model built on the meta device (Note [Models on the meta device]).

Each test builds the model under torch.device("meta"), where no tensor has memory, and checks what initialize()
makes of it against the same model built in memory, or that a model it cannot make is refused, named, and left on
the meta device for a retry.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import tierzero.torch as tzt
from conftest import host_config
from test_torch import TOL, _adamw_like, _mlp_batches, largest_error, mlp


def on_meta(build):
    with torch.device("meta"):
        return build()


def all_meta(model):
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_the_same_seed_makes_the_same_weights_and_the_same_training(nvme_dir):
    # Modules are made children first, as their constructors initialise them: with reset_parameters() and the
    # same seed, the weights are those of the model built in memory, bit for bit, and so is the training.
    torch.manual_seed(0)
    ref = mlp()
    torch.manual_seed(0)
    model = on_meta(mlp)
    ids = [id(p) for p in model.parameters()]
    config = host_config(nvme_dir, clip=1.0)
    engine, *_ = tzt.initialize(model, config)
    assert [id(p) for p in model.parameters()] == ids, "the parameters are the model's own objects still"
    master = engine.master_state_dict()
    assert all(torch.equal(master[n], p.detach()) for n, p in ref.named_parameters())
    opt = _adamw_like(config, ref.parameters())
    for x, y in _mlp_batches(1, 5):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    err = largest_error(engine, ref)
    print(f"meta-built MLP, 5 steps against the one built in memory: largest |tierzero - torch| = {err:.3g}")
    assert err <= TOL


def test_a_parents_initialisation_of_its_children_holds(nvme_dir):
    # torch's MultiheadAttention zeroes its child out_proj's bias after the child drew it; without that
    # parent's step the bias would be Linear's uniform draw.
    layer = on_meta(lambda: torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True))
    for p in layer.self_attn.out_proj.parameters():  # MultiheadAttention reads them without calling out_proj
        tzt.register_external_parameter(layer.self_attn, p)
    engine, *_ = tzt.initialize(layer, host_config(nvme_dir))
    master = engine.master_state_dict()
    assert torch.equal(master["self_attn.out_proj.bias"], torch.zeros(64))
    assert torch.equal(master["self_attn.in_proj_bias"], torch.zeros(192))
    bound = math.sqrt(6 / (64 + 192))  # xavier_uniform_ of in_proj_weight (192, 64)
    w = master["self_attn.in_proj_weight"]
    assert 0.9 * bound < float(w.abs().max()) <= bound
    assert torch.equal(master["norm1.weight"], torch.ones(64))
    x = torch.randn(2, 5, 64)
    engine.backward(engine(x).square().mean())
    engine.step()
    assert engine.global_steps == 1


def test_gpt2_gets_its_scaled_residual_initialisation(nvme_dir):
    # Hugging Face GPT-2's _init_weights, called on an attention or MLP module, re-draws its child c_proj's
    # weight with std 0.02 / sqrt(2 n_layer): init_fn runs on each module's parents too, so it lands.
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4)
    model = on_meta(lambda: transformers.GPT2LMHeadModel(cfg))
    engine, *_ = tzt.initialize(model, host_config(nvme_dir, lr=1e-3), init_fn=model._init_weights)
    master = engine.master_state_dict()
    scaled = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, std in (("transformer.h.1.attn.c_proj.weight", scaled), ("transformer.h.1.mlp.c_proj.weight", scaled),
                      ("transformer.h.1.mlp.c_fc.weight", 0.02), ("transformer.wte.weight", 0.02)):
        got = float(master[name].std())
        assert abs(got - std) < 0.05 * std, (name, got, std)  # 65K+ draws: the std within 5%
    assert torch.equal(master["transformer.h.1.ln_1.weight"], torch.ones(128))
    assert model.lm_head.weight is model.transformer.wte.weight, "the tie holds"
    ids = torch.randint(0, 512, (2, 16))
    out = engine(ids, labels=ids)
    assert math.isfinite(out.loss.item())
    engine.backward(out.loss)
    engine.step()


class TiedHead(torch.nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.norm = torch.nn.BatchNorm1d(d)
        self.head = torch.nn.Linear(d, vocab)  # with a bias of its own
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def test_tied_weights_with_a_bias_and_buffers(nvme_dir):
    torch.manual_seed(3)
    ref = TiedHead()
    torch.manual_seed(3)
    model = on_meta(TiedHead)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    assert model.head.weight is model.emb.weight
    master = engine.master_state_dict()
    assert set(master) == {"emb.weight", "norm.weight", "norm.bias", "head.bias"}
    # The embedding is drawn first in both; the model built in memory then drew a head weight the tie
    # discarded, so the bias comes from a later point of the random stream: Linear's bound, not its values.
    assert torch.equal(master["emb.weight"], ref.emb.weight.detach())
    assert 0 < float(master["head.bias"].abs().max()) <= 1 / math.sqrt(16)
    # Buffers stay with torch, made, on the engine's device.
    assert torch.equal(model.norm.running_var, torch.ones(16)) and model.norm.running_var.device.type == "cpu"
    assert int(model.norm.num_batches_tracked) == 0
    engine.backward(F.cross_entropy(engine(torch.randint(0, 40, (8,))), torch.randint(0, 40, (8,))))
    engine.step()
    assert int(model.norm.num_batches_tracked) == 1


def test_a_failed_initialize_leaves_the_model_on_meta_for_a_retry(nvme_dir):
    model = on_meta(mlp)
    params = list(model.parameters())
    seen = []

    def init_fn(module):
        seen.append(type(module).__name__)
        if isinstance(module, torch.nn.LayerNorm):
            raise KeyError("no LayerNorm today")
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with pytest.raises(KeyError, match="no LayerNorm today"):
        tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    assert "Linear" in seen and all_meta(model), "every tensor is back on the meta device"
    assert list(model.parameters()) == params or all(a is b for a, b in zip(model.parameters(), params))
    torch.manual_seed(0)
    ref = mlp()
    torch.manual_seed(0)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))  # the retry makes it from scratch
    master = engine.master_state_dict()
    assert all(torch.equal(master[n], p.detach()) for n, p in ref.named_parameters())


class Leaky(torch.nn.Module):
    """reset_parameters() sets the weight but forgets the scale."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(8, 8))
        self.scale = torch.nn.Parameter(torch.empty(8))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.normal_(self.weight)

    def forward(self, x):
        return (x @ self.weight) * self.scale


class NoReset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.weight


def test_what_cannot_be_made_is_refused_naming_it(nvme_dir):
    config = host_config(nvme_dir)
    # A tensor no initialisation set (it would train from uninitialised memory): refused, named, undone.
    model = on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), Leaky()))
    with pytest.raises(ValueError, match=r"'1\.scale' \(on the meta device\) was not set everywhere by "
                                         r"reset_parameters\(\)"):
        tzt.initialize(model, config)
    assert all_meta(model)
    # A module with meta tensors and no reset_parameters(): refused before anything is made.
    model = on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), NoReset()))
    with pytest.raises(ValueError, match=r"module '1' \(NoReset\) has tensors on the meta device and no "
                                         r"reset_parameters\(\).*pass init_fn="):
        tzt.initialize(model, config)
    # With init_fn it is made.
    engine, *_ = tzt.initialize(model, config, init_fn=lambda m: [torch.nn.init.ones_(p) for p in
                                                               m.parameters(recurse=False)])
    assert torch.equal(engine.master_state_dict()["1.weight"], torch.ones(8, 8))
    # Meta and real tensors in one model: refused, naming one of each.
    mixed = torch.nn.Sequential(on_meta(lambda: torch.nn.Linear(8, 8)), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"both on the meta device \('0\.weight', 2 in all\) and off it "
                                         r"\('1\.weight', 2 in all\)"):
        tzt.initialize(mixed, config)
    # init_fn for a model with nothing on the meta device would be ignored: refused instead.
    with pytest.raises(ValueError, match="init_fn= makes a model built on the meta device"):
        tzt.initialize(mlp(), config, init_fn=lambda m: None)
    with pytest.raises(TypeError, match="init_fn must be callable"):
        tzt.initialize(on_meta(mlp), config, init_fn="normal")


class Positions(torch.nn.Module):
    """Integer and bool buffers computed in __init__: on the meta device no reset_parameters() makes them."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("idx", torch.arange(4))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)))

    def reset_parameters(self):
        pass

    def forward(self, x):
        return self.lin(x)[:, self.idx]


def test_integer_and_bool_buffers_nothing_set_are_refused(nvme_dir):
    config = host_config(nvme_dir)
    model = on_meta(Positions)
    with pytest.raises(ValueError, match=r"'idx' \(on the meta device\) was not set everywhere by "
                                         r"reset_parameters\(\)"):
        tzt.initialize(model, config)
    assert all_meta(model)
    # A bool tensor half written: the rest still holds the byte 0xFF, which no bool write leaves.
    half = on_meta(Positions)
    with pytest.raises(ValueError, match=r"'mask' \(on the meta device\) was not set everywhere by init_fn"):
        tzt.initialize(half, config, init_fn=lambda m: (m.reset_parameters() if isinstance(m, torch.nn.Linear)
                                                       else None, m.idx.copy_(torch.arange(4))
                                                       if isinstance(m, Positions) else None,
                                                       m.mask[:2].fill_(True) if isinstance(m, Positions) else None))
    assert all_meta(half)

    def init_fn(module):
        if isinstance(module, Positions):
            module.idx.copy_(torch.arange(4))
            module.mask.copy_(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
        elif isinstance(module, torch.nn.Linear):
            module.reset_parameters()

    tzt.initialize(model, config, init_fn=init_fn)
    assert torch.equal(model.idx, torch.arange(4)) and int(model.mask.sum()) == 10


def test_refusals_that_need_no_making_leave_the_model_on_meta(nvme_dir):
    # A bf16 parameter under an fp32 config, and a queued register_external_parameter of a frozen one:
    # refused before anything is made, so the retry with a right config finds the model as it was.
    model = on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.bfloat16), torch.nn.Linear(4, 4)))
    model[1].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="parameter '0.weight' is torch.bfloat16"):
        tzt.initialize(model, host_config(nvme_dir))
    assert all_meta(model)
    tzt.register_external_parameter(model[0], model[1].weight)
    bf16 = dict(host_config(nvme_dir), bf16={"enabled": True})
    with pytest.raises(ValueError, match="not one the engine trains"):
        tzt.initialize(model, bf16)
    assert all_meta(model)
    model[0].__dict__.pop("_tierzero_external")
    engine, *_ = tzt.initialize(model, bf16)
    assert model[1].weight.dtype == torch.bfloat16 and not model[1].weight.is_meta  # frozen: kept, 16-bit
    assert sorted(engine.master_state_dict()) == ["0.bias", "0.weight", "1.bias"]


def test_with_init_fn_tied_and_shared_modules_end_as_model_apply_leaves_them(nvme_dir):
    # model.apply(init_fn) runs init_fn on every holder of a tied weight, and on every parent of a shared
    # module; the last one's word stands.
    def init_fn(module):
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight)
        elif isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.ones_(module.bias)
        elif isinstance(module, Zeroing):
            torch.nn.init.zeros_(module.inner.bias)
        elif isinstance(module, torch.nn.BatchNorm1d):
            module.reset_parameters()

    tied = on_meta(TiedHead)
    engine, *_ = tzt.initialize(tied, host_config(nvme_dir), init_fn=init_fn)
    reference = TiedHead()
    reference.apply(init_fn)
    master = engine.master_state_dict()
    assert float(reference.emb.weight.detach().abs().sum()) == 0.0 and torch.equal(master["emb.weight"], torch.zeros(40, 16))
    assert torch.equal(master["head.bias"], torch.ones(40))

    def shared_model():
        inner = torch.nn.Linear(4, 4)
        return torch.nn.Sequential(torch.nn.Sequential(inner), Zeroing(inner))

    shared = on_meta(shared_model)
    engine, *_ = tzt.initialize(shared, host_config(nvme_dir), init_fn=init_fn)
    assert torch.equal(engine.master_state_dict()["0.0.bias"], torch.zeros(4)), "the second parent's init holds"


class Zeroing(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_an_init_fn_that_keeps_a_view_is_named_when_its_tensor_cannot_go_back(nvme_dir):
    kept = []

    def init_fn(module):
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
            kept.append(module.bias[:2])  # holds the bias: it cannot be swapped back to the meta device

    model = on_meta(mlp)
    with pytest.raises(ValueError, match=r"'0\.bias' cannot be swapped between the meta device and memory: "
                                         r"something else holds it"):
        tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)


def test_an_interrupt_inside_initialize_is_raised_and_the_model_restored(nvme_dir):
    class Stop(BaseException):
        pass

    def init_fn(module):
        if isinstance(module, torch.nn.LayerNorm):
            raise Stop()
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    model = on_meta(mlp)
    with pytest.raises(Stop):
        tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    assert all_meta(model)


class Halving(torch.nn.Module):
    """A parent whose initialisation scales its children's weights: applied twice, they would be quartered."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.a.requires_grad_(False)  # frozen: kept by torch, not the engine
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            for lin in (self.a, self.b):
                lin.weight.mul_(0.5)

    def forward(self, x):
        return self.norm(self.b(self.a(x)))


def test_each_initialisation_reaches_a_tensor_once(nvme_dir):
    # Later visits call the parents' initialisations again; the tensors made before are parked on the meta
    # device by then, so a parent's scaling lands once, as in the model built in memory (and model.apply).
    torch.manual_seed(4)
    ref = torch.nn.Sequential(Halving())
    torch.manual_seed(4)
    model = on_meta(lambda: torch.nn.Sequential(Halving()))
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    assert torch.equal(model[0].a.weight, ref[0].a.weight.detach()), "the frozen weight, halved once"
    assert torch.equal(engine.master_state_dict()["0.b.weight"], ref[0].b.weight.detach())

    def init_fn(module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)
        elif isinstance(module, Halving):
            module.reset_parameters()
        elif isinstance(module, torch.nn.BatchNorm1d):
            module.reset_parameters()

    model = on_meta(lambda: torch.nn.Sequential(Halving()))
    engine, *_ = tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    ref = torch.nn.Sequential(Halving())
    with torch.no_grad():
        ref.apply(init_fn)
    assert torch.equal(model[0].a.weight, ref[0].a.weight) and torch.equal(model[0].a.weight, torch.full((4, 4), 0.5))
    assert torch.equal(engine.master_state_dict()["0.b.weight"], torch.full((4, 4), 0.5))


class Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("f64", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("idx", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("none", torch.zeros(0, dtype=torch.int64))

    def forward(self, x):
        return self.lin(x)


def test_buffers_keep_their_dtype_under_fp32_and_writes_through_data_count(nvme_dir):
    def init_fn(module):
        if isinstance(module, Buffers):
            module.f64.fill_(1 / 3)
            module.idx.data.copy_(torch.arange(4))  # through .data: no version bump, still a write
        elif isinstance(module, torch.nn.Linear):
            module.reset_parameters()

    model = on_meta(Buffers)
    tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    assert model.f64.dtype == torch.float64 and float(model.f64[0]) == 1 / 3, "fp32 config: no cast"
    assert torch.equal(model.idx, torch.arange(4)) and model.none.numel() == 0

    # An integer tensor written by an operation holds what it was given, whatever the value (the fill that
    # marks unset elements, the most negative integer, is also a value someone may mean).
    def lowest(module):
        init_fn(module)
        if isinstance(module, Buffers):
            module.idx.fill_(torch.iinfo(torch.int64).min)

    model = on_meta(Buffers)
    tzt.initialize(model, host_config(nvme_dir), init_fn=lowest)
    assert torch.equal(model.idx, torch.full((4,), torch.iinfo(torch.int64).min))


def test_a_shared_module_gets_every_call_model_apply_makes(nvme_dir):
    # model.apply calls init_fn on a shared module at each of its places: the second call (ones) comes after
    # the first parent set the weight to 3, and stands.
    class Parent(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    def build():
        shared = torch.nn.Linear(4, 4)
        return torch.nn.Sequential(Parent(shared), Parent(shared))

    def init_fn(module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)
        elif isinstance(module, Parent) and module is first:
            torch.nn.init.constant_(module.inner.weight, 3.0)

    model = on_meta(build)
    first = model[0]
    engine, *_ = tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    ref = build()
    first = ref[0]
    with torch.no_grad():
        ref.apply(init_fn)
    assert torch.equal(engine.master_state_dict()["0.inner.weight"], ref[0].inner.weight)
    assert torch.equal(ref[0].inner.weight, torch.ones(4, 4))


class TaggedParam(torch.nn.Parameter):
    pass


class Tagged(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = TaggedParam(torch.empty(4, 4))
        self.w.init_std = 0.5  # read by the initialisation, as some models tag their parameters
        self.b = torch.nn.Parameter(torch.empty(4))

    def reset_parameters(self):
        torch.nn.init.normal_(self.w, std=self.w.init_std)
        torch.nn.init.zeros_(self.b)
        self.b.no_decay = True  # a tag the initialisation adds

    def forward(self, x):
        return x @ self.w + self.b


def test_parameters_keep_their_class_and_attributes(nvme_dir):
    model = on_meta(Tagged)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    assert type(model.w) is TaggedParam and model.w.init_std == 0.5 and model.b.no_decay is True
    std = float(engine.master_state_dict()["w"].std())
    assert 0.2 < std < 0.8, std  # drawn with the tagged std, not a default


def test_a_tied_weight_gets_a_common_parents_initialisation_once(nvme_dir):
    class Head(torch.nn.Module):  # holds the embedding's weight; its own init leaves it alone
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = Head(self.emb.weight)

    def init_fn(module):
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.ones_(module.weight)
        elif isinstance(module, Model):
            module.emb.weight.mul_(0.5)

    model = on_meta(Model)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    ref = Model()
    with torch.no_grad():
        ref.apply(init_fn)
    assert torch.equal(engine.master_state_dict()["emb.weight"], ref.emb.weight) and float(ref.emb.weight[0, 0].detach()) == 0.5


def test_what_swapping_cannot_make_is_refused_naming_it(nvme_dir):
    # nn.LSTM keeps weak references to its parameters, which swap_tensors refuses to swap.
    model = on_meta(lambda: torch.nn.LSTM(4, 4))
    with pytest.raises(ValueError, match=r"'weight_ih_l0' cannot be swapped .* weak reference"):
        tzt.initialize(model, host_config(nvme_dir))
    assert all_meta(model)
    # An initialisation that reads another module's tensor finds it on the meta device: torch's error, with
    # a note saying where and why.
    copying = on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))

    def init_fn(module):
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
        if module is copying:
            module[1].weight.copy_(module[0].weight)

    with pytest.raises(NotImplementedError) as info:
        tzt.initialize(copying, host_config(nvme_dir), init_fn=init_fn)
    assert any("cannot run there: that tensor is on the meta device" in n for n in info.value.__notes__)
    assert all_meta(copying)


class Holder(torch.nn.Module):
    def __init__(self, k, w=None):
        super().__init__()
        self.k = k
        self.w = w if w is not None else torch.nn.Parameter(torch.empty(4))
        self.bias = torch.nn.Parameter(torch.empty(4))


class TwoHolders(torch.nn.Module):
    """a and b hold one weight; the parent scales every parameter, and sets b's bias from the tied weight."""

    def __init__(self):
        super().__init__()
        self.a = Holder(1.0)
        self.b = Holder(2.0, self.a.w)


def test_a_tied_weight_has_every_holders_call_in_apply_order(nvme_dir):
    def init_fn(module):
        if isinstance(module, Holder):
            module.w.fill_(module.k)
            module.bias.zero_()
        elif isinstance(module, TwoHolders):
            for p in module.parameters():
                p.mul_(0.5)
            module.b.bias.copy_(module.b.w)  # reads the tied weight, made at b's visit

    model = on_meta(TwoHolders)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir), init_fn=init_fn)
    ref = TwoHolders()
    with torch.no_grad():
        ref.apply(init_fn)
    master = engine.master_state_dict()
    assert float(ref.a.w[0].detach()) == 1.0 and torch.equal(master["a.w"], ref.a.w.detach())  # b's 2, halved
    assert torch.equal(master["b.bias"], ref.b.bias.detach())
