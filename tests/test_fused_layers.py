"""kernels/fused_layers.py: the Triton RMSNorm, SwiGLU and RoPE, forward and backward, against float64
references (interpreted on the CPU, compiled on a GPU), and their use by the model.

Tolerances: each kernel computes in fp32 and rounds once to the output dtype. fp32 outputs: a
few fp32 roundings of sums over at most a few thousand terms, relative to the output's scale
(FP32_TOL). bf16 outputs: one bf16 rounding (2^-8 of the element) on top of that."""
import pytest
import torch
import torch.nn.functional as F

from forge_engine.kernels import fused_layers as FL
from forge_engine.model import GPT, RMSNorm, preset

# the kernels run where the Triton backend runs: compiled on a GPU machine, interpreted on CPU
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 2e-5  # of max |reference|: fp32 sums of <= 4096 terms (4096 * 6e-8 = 2.4e-4 worst
# case for a sum of same-sign terms; random signs give about sqrt(4096) * 6e-8 = 4e-6)


def close(got: torch.Tensor, ref: torch.Tensor, dtype):
    """Element-wise: |got - ref| <= rel * |ref| + FP32_TOL * max|ref| (rel: one rounding to
    dtype: 2^-8 for bf16, 2^-11 for fp16, 0 for fp32)."""
    rel = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}[dtype]
    got, ref = got.detach().double(), ref.detach().double()
    bound = rel * ref.abs() + FP32_TOL * ref.abs().max().clamp_min(1e-30)
    bad = (got - ref).abs() > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off; worst "
                           f"{float(((got - ref).abs() - bound).max()):.3g} over the bound")


def rms_ref(x, w, eps):
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu_ref(y):
    g, u = y.double().chunk(2, dim=-1)
    return F.silu(g) * u


SHAPES_NORM = [(3, 5, 37), (70, 100), (1, 3), (0, 64), (2, 9, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES_NORM)
def test_rms_norm_against_float64(shape, dtype):
    _rms_norm_case(shape, dtype, DEV)


def _rms_norm_case(shape, dtype, dev, seed=None):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) if seed is None else seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(dev).requires_grad_()
    w = (torch.randn(n, generator=g) + 1).to(dtype).to(dev).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype).to(dev)
    y = FL.rms_norm(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = rms_ref(xr, wr, 1e-5)
    if ref.numel() == 0:
        assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(dw))
        return
    rdx, rdw = torch.autograd.grad(ref, (xr, wr), dy.double())
    close(y.cpu(), ref.detach().cpu(), dtype)
    close(dx.cpu(), rdx.cpu(), dtype)
    close(dw.cpu(), rdw.cpu(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 2 * 37), (70, 2 * 1100), (1, 2), (0, 8)])
def test_swiglu_against_float64(shape, dtype):
    _swiglu_case(shape, dtype, DEV)


def _swiglu_case(shape, dtype, dev, seed=None):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) if seed is None else seed)
    y = (torch.randn(shape, generator=g) * 4).to(dtype).to(dev).requires_grad_()
    dout = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype).to(dev)
    out = FL.swiglu(y)
    assert out.dtype == dtype and out.shape == dout.shape
    _one_input_against_float64(out, y, dout, swiglu_ref, dtype)


def _one_input_against_float64(out, x, dout, ref_fn, dtype):
    """out = f(x) and its input gradient for dout against ref_fn in float64 (an empty case:
    only the gradient's shape). Returns ref_fn's float64 output."""
    (dx,) = torch.autograd.grad(out, x, dout)
    xr = x.detach().double().requires_grad_()
    ref = ref_fn(xr)
    if ref.numel() == 0:
        assert dx.shape == x.shape
        return ref
    (rdx,) = torch.autograd.grad(ref, xr, dout.double())
    close(out.cpu(), ref.detach().cpu(), dtype)
    close(dx.cpu(), rdx.cpu(), dtype)
    return ref


def rope_ref(x, cos, sin):
    """The rotation in float64 with the kernel's fp32 tables [s, d/2]."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None, None, :], sin.double()[:, None, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


SHAPES_ROPE = [(7, 2, 3, 10), (5, 1, 4, 128), (1, 1, 1, 2), (0, 2, 3, 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES_ROPE)
def test_rope_against_float64(shape, dtype):
    _rope_case(shape, dtype, DEV)


def _rope_case(shape, dtype, dev, seed=None, strided=False):
    """Forward and backward against the float64 rotation; strided: x is the key-like slice
    of a wider [s, b, heads, 3, d] tensor, as the model's k is of its QKV output."""
    from forge_engine.model import apply_rope, rope_cos_sin, rope_tables
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) if seed is None else seed)
    s, b, h, d = shape
    if strided:
        x = (torch.randn(s, b, h, 3, d, generator=g) * 3).to(dtype).to(dev)[:, :, :, 1]
    else:
        x = (torch.randn(shape, generator=g) * 3).to(dtype).to(dev)
    x.requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype).to(dev)
    theta = 10000.0 * (1 + int(torch.randint(0, 50, (), generator=g)))
    cos, sin = rope_tables(s, d, theta, dev)
    y = FL.rope(x, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape
    ref = _one_input_against_float64(y, x, dy, lambda xr: rope_ref(xr, cos, sin), dtype)
    if ref.numel() == 0:
        return
    # the tables are the torch path's (rope_cos_sin) values, and that path is within one
    # rounding of the same float64 rotation (not bit for bit with the kernel: compiled, its
    # products and sum contract into fused multiply-adds)
    c4, s4 = rope_cos_sin(s, d, theta, dev)
    assert torch.equal(torch.cat([cos, cos], -1), c4[:, 0, 0]) and \
        torch.equal(torch.cat([sin, sin], -1), s4[:, 0, 0])
    close(apply_rope(x.detach(), c4, s4).cpu(), ref.detach().cpu(), dtype)


def test_rope_strided_input_and_errors():
    _rope_case((6, 2, 3, 16), torch.float32, DEV, strided=True)
    from forge_engine.model import rope_tables
    cos, sin = rope_tables(4, 8, 1e4, DEV)
    with pytest.raises(ValueError, match=r"x must be \[s, b, heads, d\] with d even, got "
                                         r"\(4, 1, 2, 7\)"):
        FL.rope(torch.randn(4, 1, 2, 7, device=DEV), cos, sin)
    with pytest.raises(ValueError, match=r"cos must be a contiguous fp32 \[5, 4\]"):
        FL.rope(torch.randn(5, 1, 2, 8, device=DEV), cos, sin)
    with pytest.raises(TypeError, match="tensors must be one of"):
        FL.rope(torch.randn(4, 1, 2, 8, device=DEV, dtype=torch.float64), cos, sin)
    with torch.inference_mode():  # tables made here still serve a later training step
        rope_tables(9, 8, 3e4, DEV)
    x = torch.randn(9, 1, 2, 8, device=DEV, requires_grad=True)
    FL.rope(x, *rope_tables(9, 8, 3e4, DEV)).sum().backward()
    assert x.grad is not None


def test_non_contiguous_inputs_and_errors():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, 40, generator=g).to(DEV)
    x = base[:, 1:3, :].requires_grad_()  # rows of a view: a uniform row stride is not there
    w = torch.randn(40, generator=g).to(DEV).requires_grad_()
    y = FL.rms_norm(x, w, 1e-6)
    close(y, rms_ref(x.detach(), w.detach(), 1e-6), torch.float32)
    dy = torch.randn(6, 2, 40, generator=g).to(DEV)
    xr = x.detach().double().requires_grad_()
    (rdx,) = torch.autograd.grad(rms_ref(xr, w.detach(), 1e-6), xr, dy.double())
    close(torch.autograd.grad(y, x, dy)[0], rdx, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be \[40\] \(x's last dim\), got \(39,\)"):
        FL.rms_norm(x, w[:39], 1e-6)
    with pytest.raises(ValueError, match=r"last\) dim must be 1 to 32768, got x of shape"):
        FL.rms_norm(torch.randn(2, 40000, device=DEV), torch.randn(40000, device=DEV), 1e-6)
    # a strided weight is read as its values
    w2 = torch.randn(80, generator=g).to(DEV)[::2]
    close(FL.rms_norm(x.detach(), w2, 1e-6), rms_ref(x.detach(), w2, 1e-6), torch.float32)
    with pytest.raises(TypeError, match="tensors must be one of"):
        FL.rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(ValueError, match="must be even, got 41"):
        FL.swiglu(torch.randn(2, 41, device=DEV))


def test_model_uses_the_kernels_under_the_triton_backend(monkeypatch):
    """The tiny model with FORGE_BACKEND=triton (the kernels, interpreted) against the torch
    path: loss and every gradient agree to fp32 accuracy."""
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=g).to(DEV)
    out = {}
    calls, ropes = [], []
    real, real_rope = FL.rms_norm, FL.rope
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FORGE_BACKEND", backend)
        monkeypatch.setattr(FL, "rms_norm", lambda *a: calls.append(1) or real(*a))
        monkeypatch.setattr(FL, "rope", lambda *a: ropes.append(1) or real_rope(*a))
        model = GPT(cfg, seed=0, init_device=str(DEV)).to(DEV)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        out[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    # per layer 2 norms, 2 more with QK-norms; the final one; only under triton
    assert len(calls) == (4 if cfg.qk_layernorm else 2) * cfg.num_layers + 1
    assert len(ropes) == 2 * cfg.num_layers  # q and k
    (l0, g0), (l1, g1) = out["torch"], out["triton"]
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    for name in g0:
        scale = g0[name].abs().max().clamp_min(1e-30)
        assert ((g1[name] - g0[name]).abs() <= 1e-4 * scale).all(), name


def test_rmsnorm_module_dispatch(monkeypatch):
    """fp64 never reaches the kernels, even under the Triton backend: the torch ops run."""
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    norm = RMSNorm(16, 1e-6, torch.float64).to(DEV)
    x = torch.randn(3, 16, dtype=torch.float64, device=DEV, requires_grad=True)
    y = norm(x)  # torch path: a kernel would have raised TypeError
    assert y.dtype == torch.float64
    y.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(512, 1, 4096), (4096, 5120), (512, 1, 32, 128), (3, 77)])
def test_rms_norm_compiled(shape, dtype):
    for seed in range(3):
        _rms_norm_case(shape, dtype, torch.device("cuda"), seed=1000 + seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(512, 1, 2 * 14336), (4096, 2 * 12288), (3, 2 * 77)])
def test_swiglu_compiled(shape, dtype):
    for seed in range(3):
        _swiglu_case(shape, dtype, torch.device("cuda"), seed=2000 + seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,strided", [((512, 1, 32, 128), False), ((512, 1, 8, 128), True),
                                           ((300, 2, 5, 64), False), ((3, 1, 40, 128), True)])
def test_rope_compiled(shape, strided, dtype):
    for seed in range(3):
        _rope_case(shape, dtype, torch.device("cuda"), seed=3000 + seed, strided=strided)


@pytest.mark.gpu
def test_rms_norm_weight_gradient_is_deterministic():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 4096, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(4096, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(4096, 4096, generator=g).to("cuda", torch.bfloat16)
    first = torch.autograd.grad(FL.rms_norm(x, w, 1e-5), (x, w), dy)
    for _ in range(5):
        again = torch.autograd.grad(FL.rms_norm(x, w, 1e-5), (x, w), dy)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_cached_launches_match_tritons_launch(monkeypatch):
    """After a key's first launch the kernels go through the compiled launcher
    (fused_update.launch_cached): the same values bit for bit, Triton's own path not taken."""
    from forge_engine.kernels import launch as fu
    g = torch.Generator().manual_seed(9)
    x = torch.randn(300, 4096, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(4096, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    y = torch.randn(300, 2 * 1100, generator=g).to("cuda", torch.bfloat16).requires_grad_()

    def run():
        a = FL.rms_norm(x, w, 1e-5)
        b = FL.swiglu(y)
        return (a, b, *torch.autograd.grad((a, b), (x, w, y), (torch.ones_like(a),
                                                                 torch.ones_like(b))))
    fu._LAUNCHES.clear()
    first = run()
    keys = len(fu._LAUNCHES)
    assert keys == 4
    for k in (FL._rms_norm_fwd, FL._rms_norm_bwd, FL._swiglu_fwd, FL._swiglu_bwd):
        monkeypatch.setattr(k, "run", lambda *a, **kw: pytest.fail("Triton's launch path ran"))
    second = run()
    assert len(fu._LAUNCHES) == keys
    for a, b in zip(first, second):
        assert torch.equal(a, b)
