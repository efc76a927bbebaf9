"""The optimizer API: a real torch.optim.Optimizer, checkpoints, misuse errors, routing."""
import copy
import io
import warnings

import pytest
import torch
from torch import nn

import forge_engine
from forge_engine import ForgeLinear
from forge_engine.optim.fused_grad import FusedGrad


class MLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(11, 40, dtype=dtype)
        self.norm = nn.LayerNorm(40, dtype=dtype)
        self.fc2 = nn.Linear(40, 70, bias=False, dtype=dtype)
        self.fc3 = nn.Linear(70, 3, dtype=dtype)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(self.norm(self.fc1(x)))))


def loss_of(model, x, y):
    return ((model(x).float() - y) ** 2).mean()


def batch(dtype=torch.float32, device="cpu"):
    return torch.randn(9, 11, dtype=dtype, device=device), torch.randn(9, 3, device=device)


def test_swaps_linears_in_place_keeping_parameters_and_keys():
    model = MLP()
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    fc1 = model.fc1
    opt = forge_engine.optim.AdamW(model)
    assert model.fc1 is fc1 and isinstance(fc1, ForgeLinear) and isinstance(fc1, nn.Linear)
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == params
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.fused_names == ["fc1.weight", "fc2.weight", "fc3.weight"]
    assert opt.forge_summary() == ("FORGE: fused 3 of 3 weight matrices (3450 of 3450 "
                                   "parameters); standard path: none")


@pytest.mark.parametrize("updates", ["auto", "backward", "step"])
def test_fused_weights_show_a_fused_grad_until_step_and_norm_matches_torch(updates):
    """Between backward and step a fused weight's .grad is a FusedGrad (no storage: the
    gradient is never materialized); step() consumes it."""
    model = MLP()
    ref = copy.deepcopy(model)
    opt = forge_engine.optim.SGD(model, lr=0.0, updates=updates)  # lr 0: models stay equal
    x, y = batch()
    loss_of(model, x, y).backward()
    fused = (model.fc1.weight, model.fc2.weight, model.fc3.weight)
    assert all(type(p.grad) is FusedGrad and p.grad.shape == p.shape for p in fused)
    assert type(model.fc1.bias.grad) is torch.Tensor
    opt.step()
    assert all(p.grad is None for p in fused)
    loss_of(ref, x, y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(opt.grad_norm, expected, rtol=1e-5, atol=0)


def test_pending_sumsq_is_computed_once_until_a_fused_update_writes():
    """The Engine asks for the fused norm before step(), and step() asks again: with nothing
    written in between the second answer is the first (under data parallelism: one all-reduce,
    not two); a fused update or step() makes it stale."""
    model = MLP()
    opt = forge_engine.optim.SGD(model, lr=0.1)
    x, y = batch()
    loss_of(model, x, y).backward()
    a = opt.pending_sumsq(torch.device("cpu"))
    assert opt.pending_sumsq(torch.device("cpu")) is a
    opt.step()
    opt.zero_grad()
    b = opt.pending_sumsq(torch.device("cpu"))
    assert b is not a and float(b) == 0.0  # step() reset the sums
    loss_of(model, x, y).backward()
    c = opt.pending_sumsq(torch.device("cpu"))
    assert c is not b and float(c) > 0.0


def train_steps(model, opt, data):
    """One optimizer step per (x, y) of data; the losses."""
    losses = []
    for x, y in data:
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_state_dict_round_trip_resumes_bitwise(backend, device):
    """bf16 weights, int8 states, stochastic rounding: every piece of state must survive."""
    torch.manual_seed(0)
    model = MLP(torch.bfloat16).to(device)
    opt = forge_engine.optim.AdamW(model, lr=1e-2, state_dtype="int8", seed=5)
    data = [batch(torch.bfloat16, device) for _ in range(6)]
    for x, y in data[:3]:
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.int8  # fc1.weight: fused moments
    assert sd["state"][0]["exp_avg_sq"].dtype == torch.uint8
    assert sd["state"][0]["exp_avg_scale"].dtype == torch.float32
    straight = train_steps(model, opt, data[3:])

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2 = MLP(torch.bfloat16).to(device)
    opt2 = forge_engine.optim.AdamW(model2, lr=1e-2, state_dtype="int8", seed=99)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    resumed = train_steps(model2, opt2, data[3:])
    assert resumed == straight
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_of_another_optimizer_is_rejected():
    sd = forge_engine.optim.AdamW(MLP()).state_dict()
    with pytest.raises(ValueError, match="kind"):
        forge_engine.optim.SGD(MLP(), momentum=0.9).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"not a forge_engine .*torch\.optim state dict .*: "
                                         r"resume a FORGE run from its own"):
        forge_engine.optim.AdamW(MLP()).load_state_dict(torch.optim.AdamW(MLP().parameters())
                                                        .state_dict())


def test_state_loaded_in_another_format_is_kept_as_saved_with_a_warning():
    """load_state_dict restores exactly: int8 moments loaded into an optimizer made with
    state_dtype='fp32' stay int8 (its updates read them so), and the optimizer says so."""
    model = MLP()
    src = forge_engine.optim.AdamW(model, state_dtype="int8")
    x, y = batch()
    loss_of(model, x, y).backward()
    src.step()
    dst = forge_engine.optim.AdamW(copy.deepcopy(model), state_dtype="fp32")
    with pytest.warns(UserWarning, match=r"keeps the moments as saved, state_dtype='int8'; "
                                         r"this optimizer was made with state_dtype='fp32'"):
        dst.load_state_dict(src.state_dict())
    assert dst.state_dtype == "int8"
    assert all(dst.state[p]["exp_avg"].dtype == torch.int8 and "exp_avg_sq_scale" in dst.state[p]
               for p in dst._fused)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forge_engine.optim.AdamW(copy.deepcopy(model), state_dtype="int8").load_state_dict(
            src.state_dict())


def test_a_model_converted_after_its_first_step_is_refused_before_an_update():
    """model.to(torch.bfloat16) after a step: the fused weights' optimizer state began in
    fp32. The next backward is refused with one line naming the weight and the order that
    works, before any weight changes."""
    model = MLP()
    opt = forge_engine.optim.AdamW(model)
    x, y = batch()
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    model.to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"FORGE weight 'fc3\.weight' is torch\.bfloat16 now "
                                           r"and was torch\.float32 .*convert the model before "
                                           r"making the optimizer"):
        loss_of(model, x.bfloat16(), y.bfloat16()).backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_second_backward_before_step_is_an_error_before_any_update():
    model = MLP()
    opt = forge_engine.optim.AdamW(model, updates="backward")
    x, y = batch()
    loss_of(model, x, y).backward()
    after_first = model.fc3.weight.detach().clone()
    with pytest.raises(RuntimeError, match="second backward reached FORGE linear 'fc3'.*step"):
        loss_of(model, x, y).backward()
    assert torch.equal(model.fc3.weight, after_first)
    opt.step()
    loss_of(model, x, y).backward()  # fine again after step()


def test_module_applied_twice_in_one_forward_is_an_error():
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    opt = forge_engine.optim.SGD(model, lr=0.1, updates="backward")
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="applied twice"):
        model(model(x)).sum().backward()
    del opt


def test_weight_with_a_foreign_gradient_is_an_error():
    model = MLP()
    forge_engine.optim.AdamW(model)
    x, y = batch()
    loss = loss_of(model, x, y) + model.fc2.weight.pow(2).sum()
    with pytest.raises(RuntimeError, match="fc2.weight' received a gradient"):
        loss.backward()


class Tied(nn.Module):
    def __init__(self, foreign=False):
        super().__init__()
        self.emb = nn.Embedding(17, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 17, bias=False)
        self.head.weight = self.emb.weight
        self.foreign = foreign  # the weight also used outside any module FORGE updates
        if foreign:
            self.extra = nn.Module()
            self.extra.w = self.emb.weight

    def forward(self, ids):
        out = self.head(torch.tanh(self.mid(self.emb(ids))))
        return out + 0.1 * (out @ self.extra.w) @ self.extra.w.t() if self.foreign else out


def test_tied_embedding_and_head_are_one_fused_weight_and_train_exactly(backend, device):
    """nn.Embedding and nn.Linear sharing one weight: both are FORGE modules, so the weight
    is fused once, from the head's dense segment and the embedding's one-hot segment."""
    torch.manual_seed(1)
    model = Tied().to(device)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = forge_engine.optim.AdamW(model, lr=1e-2)
    assert opt.fused_names == ["emb.weight", "mid.weight"]
    assert opt.forge_summary().endswith("standard path: none")
    _train_like_torch(model, ref, opt, device)


def test_weight_shared_with_a_foreign_user_stays_standard_with_a_warning(device):
    torch.manual_seed(1)
    model = Tied(foreign=True).to(device)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="'emb.weight' is shared by emb.weight, head.weight"):
        opt = forge_engine.optim.AdamW(model, lr=1e-2)
    assert opt.fused_names == ["mid.weight"]
    assert opt.forge_summary().endswith(
        "standard path: emb.weight (shared by emb.weight, head.weight, extra.w)")
    _train_like_torch(model, ref, opt, device)


def _train_like_torch(model, ref, opt, device):
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(4):
        ids = torch.randint(0, 17, (5, 3), device=device)
        for m, o in ((model, opt), (ref, opt_ref)):
            nn.functional.cross_entropy(m(ids).reshape(-1, 17), ids.reshape(-1)).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cls,kw,match", [
    ("AdamW", dict(maximize=True), "maximize=True is not supported"),
    ("AdamW", dict(capturable=True), "capturable=True is not supported"),
    ("NAdam", dict(differentiable=True), "differentiable=True is not supported"),
    ("AdamW", dict(lr=-1.0), "invalid learning rate"),
    ("AdamW", dict(betas=(0.9, 1.0)), "invalid beta parameter at index 1"),
    ("SGD", dict(nesterov=True), "nesterov momentum requires a momentum"),
    ("RMSprop", dict(momentum=-0.1), "invalid momentum"),
    ("Adagrad", dict(lr_decay=-1), "invalid lr_decay"),
    ("AdamW", dict(state_dtype="fp8"), "state_dtype must be one of"),
])
def test_unsupported_or_invalid_options_raise_value_error(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        getattr(forge_engine.optim, cls)(MLP(), **kw)


def test_weights_of_another_dtype_warn_that_they_are_not_fused():
    """A float16 model (a checkpoint loaded in fp16): FORGE fuses fp32 and bf16 weights, so
    its linears stay on the standard path. That is said once, with the count, the dtype and
    the way out, where the optimizer is made, instead of a FORGE optimizer that silently
    saves nothing; a float16 weight beside fused fp32 ones is named the same way."""
    with pytest.warns(UserWarning, match=r"3 weight matrices that FORGE would fuse are "
                                         r"torch\.float16 \(fc1\.weight, fc2\.weight, "
                                         r"fc3\.weight\).*model\.to\(torch\.bfloat16\)") as seen:
        opt = forge_engine.optim.AdamW(MLP(torch.float16))
    assert len(seen) == 1 and seen[0].filename == __file__
    assert opt.forge_summary().startswith("FORGE: fused 0 of 3 weight matrices")
    model = MLP()
    model.fc2.half()
    with pytest.warns(UserWarning, match=r"1 weight matrix that FORGE would fuse is "
                                         r"torch\.float16 \(fc2\.weight\)"):
        opt = forge_engine.optim.AdamW(model)
    assert opt.forge_summary().startswith("FORGE: fused 2 of 3 weight matrices")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forge_engine.optim.AdamW(MLP(torch.bfloat16))


class _TransposedLinear(nn.Module):
    """y = x W + b with W [in, out], as transformers' Conv1D (GPT-2) keeps it."""

    def __init__(self, k, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_weights_of_modules_forge_does_not_bind_warn():
    """A weight matrix of a module FORGE does not bind (not an nn.Linear, nn.Embedding or
    nn.MultiheadAttention: transformers' Conv1D, a bare nn.Parameter) stays on the standard
    path, saving no memory: one warning where the optimizer is made, with the count over the
    model's weight matrices and the first ones by name and reason. A weight the caller kept
    there (standard=...) is not warned about."""
    model = nn.Sequential(nn.Linear(5, 6), _TransposedLinear(6, 4), _TransposedLinear(4, 3))
    with pytest.warns(UserWarning, match=r"2 of the model's 3 weight matrices stay on the "
                                         r"standard optimizer path .*: 1\.weight \(not the "
                                         r"weight of an nn\.Linear.*\), 2\.weight \(.*"
                                         r"forge_summary\(\)") as seen:
        opt = forge_engine.optim.AdamW(model)
    assert len(seen) == 1 and seen[0].filename == __file__
    assert opt.forge_summary().startswith("FORGE: fused 1 of 3 weight matrices")
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forge_engine.optim.AdamW(model, standard=["1.weight"])


def test_stacked_expert_weights_are_counted_and_warned_about():
    """transformers' MoE layers (Qwen3-MoE, Mixtral) keep their experts as 3-D weights
    [experts, out, in], most of such a model's parameters. FORGE fuses 2-D matrices, so they
    stay on the standard path: counted in forge_summary()'s totals and warned about, where
    before the summary left them out and read as nearly all fused."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                      moe_intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2, head_dim=8)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    stacked = [(n, p) for n, p in model.named_parameters() if p.dim() == 3]
    assert len(stacked) == 4
    share = sum(p.numel() for _, p in stacked) + 2 * 4 * 32  # and the routers [4, 32]
    share = f"{share / sum(p.numel() for p in model.parameters() if p.dim() >= 2):.0%}"
    with pytest.warns(UserWarning, match=r"6 of the model's 16 weight matrices stay .*no "
                                         f"memory saving for {share} of the weight "
                                         r"matrices' parameters\): "
                                         r"model\.layers\.0\.mlp\.experts\.gate_up_proj "
                                         r"\(3-D; FORGE fuses matrices, not stacked experts"):
        opt = forge_engine.optim.AdamW(model)
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    fused = sum(p.numel() for p in opt._fused)
    assert opt.forge_summary().startswith(
        f"FORGE: fused 10 of 16 weight matrices ({fused} of {total} parameters)")
    assert fused + sum(p.numel() for _, p in stacked) < total  # (the routers stay too)
    with warnings.catch_warnings():  # kept there by the caller: nothing to warn about
        warnings.simplefilter("error")
        forge_engine.optim.AdamW(transformers.Qwen3MoeForCausalLM(cfg), standard=[
            n for n, p in model.named_parameters() if p.dim() == 3 or "mlp.gate" in n])
        forge_engine.optim.AdamW(transformers.Qwen3MoeForCausalLM(cfg), fuse=False)


def test_conv1d_that_cannot_fuse_is_named():
    """transformers' Conv1D fuses (tests/test_drop_in.py trains GPT-2); a subclass of it, whose
    forward FORGE would replace, does not, nor does a weight one Conv1D and one nn.Linear
    share (one slot updates W in one orientation): each stays on the standard path, named
    with its reason in the warning and in forge_summary()."""
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D

    class Scaled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    shared = nn.Linear(6, 6, bias=False)
    conv = Conv1D(6, 6)
    conv.weight = shared.weight
    model = nn.Sequential(Conv1D(6, 5), Scaled(4, 6), shared, conv)
    with pytest.warns(UserWarning, match=r"2 of the model's 3 weight matrices stay .*: "
                                         r"1\.weight \(Scaled is a subclass of transformers' "
                                         r"Conv1D, .*\), 2\.weight \(used both as W \[in, out\] "
                                         r"\(Conv1D\) and as W \[out, in\]\)"):
        opt = forge_engine.optim.AdamW(model)
    summary = opt.forge_summary()
    assert summary.startswith("FORGE: fused 1 of 3 weight matrices")
    assert "1.weight (Scaled is a subclass" in summary and "2.weight (used both" in summary
    assert type(model[0]).__name__ == "ForgeConv1D" and type(model[1]) is Scaled
    assert type(model[3]) is Conv1D
    buf = io.BytesIO()  # copies are plain transformers modules, as a copied nn.Linear is
    torch.save(model[0], buf)
    buf.seek(0)
    for copied in (copy.deepcopy(model[0]), torch.load(buf, weights_only=False)):
        assert type(copied) is Conv1D and torch.equal(copied.weight, model[0].weight)


def test_a_second_optimizer_over_the_models_parameters_is_refused():
    """torch.optim.AdamW made beside FORGE's optimizer over the same parameters reads the fused
    weights' .grad, which never exists: one error naming the weight and that cause (in the
    torch optimizer's step(), which may have decayed the weights already)."""
    model = MLP()
    forge_engine.optim.AdamW(model)
    other = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch()
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"on the \.grad of FORGE weight 'fc\d\.weight'.*"
                                           r"A second optimizer over the same model's "
                                           r"parameters .*one optimizer per model"):
        other.step()


def test_first_argument_must_be_the_model():
    """Parameters or parameter groups, as torch.optim takes them (and transformers.Trainer's
    optimizer_cls_and_kwargs passes), get one line that names the way Trainer takes FORGE."""
    for wrong in (MLP().parameters(), [{"params": list(MLP().parameters())}]):
        with pytest.raises(TypeError, match=r"first argument is the model .* got (generator|"
                                            r"list); .*optimizers=\(optimizer, None\)"):
            forge_engine.optim.AdamW(wrong)


def test_one_optimizer_per_model():
    model = MLP()
    forge_engine.optim.AdamW(model)
    with pytest.raises(ValueError, match="already updated by another FORGE optimizer"):
        forge_engine.optim.SGD(model)


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "cuda")
    model = MLP()
    forge_engine.optim.SGD(model, updates="backward")
    x, y = batch()
    with pytest.raises(ValueError, match="FORGE_BACKEND must be one of"):
        loss_of(model, x, y).backward()


def test_default_state_formats_follow_the_weights():
    for dtype, fmt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        model = MLP(dtype)
        opt = forge_engine.optim.AdamW(model)
        x, y = batch(dtype)
        loss_of(model, x, y).backward()
        opt.step()
        assert opt.state[model.fc1.weight]["exp_avg"].dtype == fmt


def test_no_grad_forward_is_plain_and_untouched():
    model = MLP()
    forge_engine.optim.AdamW(model)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model(torch.randn(2, 11))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.eval()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_nonfinite_gradients_are_never_written_and_reported():
    """Fused weights (kernel tiles), standard-path parameters and fp32-buffer accumulation alike:
    a non-finite gradient leaves the parameter as it was, and grad_norm is not finite."""
    model = MLP()
    opt = forge_engine.optim.AdamW(model, lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    x[0, 0] = float("nan")
    opt.defer_updates()  # 9 tokens: fc1, fc3 switch to fp32 buffers, fc2 keeps segments (kernel)
    loss_of(model, x, y).backward()
    opt.step()
    assert not torch.isfinite(opt.grad_norm)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_no_forge_adamw_on_cuda_is_apex_fused_adam_where_importable(monkeypatch):
    """The forge=False AdamW on CUDA: apex's FusedAdam (adam_w_mode) where apex imports (NVIDIA
    images; a stand-in module here, apex is not installable), else torch's fused AdamW."""
    import sys
    import types

    from forge_engine.engine import fused_adamw

    calls = []

    class FakeFusedAdam(torch.optim.Optimizer):
        def __init__(self, params, adam_w_mode=False, **kw):
            calls.append((adam_w_mode, kw))
            super().__init__(params, dict(kw))

    params = [nn.Parameter(torch.zeros(3))]
    fake = types.ModuleType("apex.optimizers")
    fake.FusedAdam = FakeFusedAdam
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.optimizers", fake)
    opt = fused_adamw(params, lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, FakeFusedAdam) and calls == [(True, dict(lr=1e-3, weight_decay=0.1))]
    monkeypatch.setitem(sys.modules, "apex.optimizers", None)  # not importable
    if torch.cuda.is_available():
        opt = fused_adamw([nn.Parameter(torch.zeros(3, device="cuda"))], lr=1e-3)
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]


def test_int8_state_dict_of_the_former_linear_code_is_refused():
    """int8 first moments are stored as signed square-root codes (int8_code 2); a state dict
    of the former linear code would decode wrongly and is refused in one line (fp32 / bf16 state
    dicts have no codes and load as before)."""
    model = MLP()
    opt = forge_engine.optim.AdamW(model, state_dtype="int8")
    loss_of(model, *batch()).backward()
    opt.step()
    sd = opt.state_dict()
    old = copy.deepcopy(sd)
    del old["forge"]["int8_code"]
    fresh = forge_engine.optim.AdamW(MLP(), state_dtype="int8")
    with pytest.raises(ValueError, match="former linear code"):
        fresh.load_state_dict(old)
    fresh.load_state_dict(sd)
    plain = forge_engine.optim.AdamW(MLP())
    plain_sd = forge_engine.optim.AdamW(MLP()).state_dict()
    del plain_sd["forge"]["int8_code"]
    plain.load_state_dict(plain_sd)


def test_sumsq_all_against_float64():
    """The sum of squared gradient norms (Engine's global norm, clip_grad_norm_): one foreach
    norm per dtype, accumulated in at least fp32, against the float64 sum; an empty list is
    0, a non-finite gradient makes it non-finite, fp64 gradients keep fp64."""
    from forge_engine.optim.base import sumsq_all
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    grads = [torch.randn(37, 5, generator=g).bfloat16(), torch.randn(1000, generator=g),
             torch.randn(3, generator=g).bfloat16() * 100, torch.randn(2, 2, generator=g)]
    ref = sum(float(t.double().square().sum()) for t in grads)
    got = sumsq_all(grads, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - ref) <= 1e-5 * ref  # fp32 sums of at most 1000 terms
    assert float(sumsq_all([], torch.device("cpu"))) == 0.0
    bad = grads + [torch.tensor([float("inf")])]
    assert not torch.isfinite(sumsq_all(bad, torch.device("cpu")))
    d = [t.double() for t in grads]
    out = sumsq_all(d, torch.device("cpu"))
    assert out.dtype == torch.float64 and abs(float(out) - ref) <= 1e-12 * ref
