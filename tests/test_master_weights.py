"""fp32 master weights for the --no-forge bf16 baseline (forge_engine/optim/master_weights.py).

Weights drawn in [1, 2), where a bf16 weight's half ulp is 2^-8 = 3.9e-3. AdamW with lr 1e-3,
betas (0.9, 0.95): |m_hat / sqrt(v_hat)| <= sqrt(sum_k (0.1 * 0.9^k)^2 / (0.05 * 0.95^k)) = 1.17
(Cauchy-Schwarz), so one step moves a weight by at most 1.17e-3 + lr * wd * 2 = 1.4e-3: below
half an ulp, so plain bf16 AdamW (round to nearest) never moves a weight, while the fp32
copies add the updates up and the bf16 weights follow them.
"""
import pytest
import torch

from forge_engine.engine import fused_adamw
from forge_engine.optim.master_weights import MasterWeights

STEPS, LR, WD, BETAS = 50, 1e-3, 0.1, (0.9, 0.95)


def params(device="cpu"):
    return [(1 + torch.rand(37, 53, device=device)).bfloat16().requires_grad_(),
            (1 + torch.rand(29, device=device)).bfloat16().requires_grad_()]


def adamw(ps):
    """pretrain.py's: torch's fused AdamW on CUDA (engine.fused_adamw), else its default."""
    if ps[0].is_cuda:
        return fused_adamw(ps, lr=LR, betas=BETAS, weight_decay=WD)
    return torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD)


def run(opt, ps, grads):
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_master_weights_follow_float64_adamw_where_plain_bf16_loses_every_update(device):
    ps = params(device)
    p0 = [p.detach().clone() for p in ps]
    grads = [[torch.randn(p.shape, device=device).bfloat16() for p in ps] for _ in range(STEPS)]
    opt = MasterWeights(ps, adamw)
    run(opt, ps, grads)

    ref = [p.detach().double().requires_grad_() for p in p0]  # torch's AdamW in float64
    ref_opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    run(ref_opt, ref, [[g.double() for g in step] for step in grads])

    plain = [p.detach().clone().requires_grad_() for p in p0]
    run(adamw(plain), plain, grads)

    for p, m, r, q, start in zip(ps, opt.masters, ref, plain, p0):
        # fp32 copy vs float64: each step stores the copy once (half an ulp of 2^-23 at
        # [1, 2)) and its fp32 states perturb the ~1e-3 update by ~1e-9: steps x 2^-23 bounds it
        torch.testing.assert_close(m.double(), r.detach(), rtol=0, atol=STEPS * 2 ** -23)
        assert torch.equal(p.detach(), m.bfloat16())  # the weight is the copy, rounded
        assert not torch.equal(p.detach(), start)  # ... and it moved
        assert torch.equal(q.detach(), start)  # plain bf16 AdamW lost every update
    assert opt.state[opt.masters[0]]["exp_avg"].dtype == torch.float32


def test_state_dict_resumes_bit_for_bit():
    ps_a = params()
    ps_b = [p.detach().clone().requires_grad_() for p in ps_a]
    grads = [[torch.randn(p.shape).bfloat16() for p in ps_a] for _ in range(10)]
    a = MasterWeights(ps_a, adamw)
    run(a, ps_a, grads)
    b = MasterWeights(ps_b, adamw)
    run(b, ps_b, grads[:5])
    saved = b.state_dict()
    ps_c = [p.detach().clone().requires_grad_() for p in ps_b]  # the bf16 weights saved
    c = MasterWeights(ps_c, adamw)  # its copies start from the rounded weights ...
    c.load_state_dict(saved)  # ... until the saved fp32 copies replace them
    run(c, ps_c, grads[5:])
    for pa, pc, ma, mc in zip(ps_a, ps_c, a.masters, c.masters):
        assert torch.equal(pa, pc) and torch.equal(ma, mc)


def test_lr_written_into_param_groups_drives_the_inner_optimizer():
    ps = params()
    opt = MasterWeights(ps, adamw)
    for g in opt.param_groups:
        g["lr"] = 0.0
    run(opt, ps, [[torch.randn(p.shape).bfloat16() for p in ps]])
    for p, m in zip(ps, opt.masters):  # lr 0: neither the update nor the decay moves it
        assert torch.equal(m.bfloat16(), p.detach())
        assert torch.equal(m, p.detach().float())


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="fp32 master weights are for bf16 weights; these are "
                                         "torch.float32"):
        MasterWeights([torch.zeros(3, requires_grad=True)], adamw)
    opt = MasterWeights(params(), adamw)
    with pytest.raises(ValueError, match="not a fp32-master-weights optimizer state"):
        opt.load_state_dict(adamw([torch.zeros(3, requires_grad=True)]).state_dict())
    bad = opt.state_dict()
    bad["master_params"] = bad["master_params"][:1]
    with pytest.raises(ValueError, match="do not match this model's parameters"):
        opt.load_state_dict(bad)
