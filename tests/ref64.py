"""An independent reference of the optimizers' steps, for the kernel tests (float64 by default).

Written from the algorithms as published, not from forge_engine: the pseudo-code boxes of the
torch.optim documentation (SGD, AdamW, NAdam, RAdam, RMSprop, Adagrad) and Lion's Algorithm 2
(Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"). Nothing here imports
forge_engine.optim: the per-step scalars (bias corrections, NAdam's momentum products, RAdam's
rectification, Adagrad's decayed lr) are computed from the optimizer's options and the step
number t, in the form the documentation writes them, so that neither a wrong update rule nor a
wrong folding of the hyperparameters (rules.hparams, shared by the kernels and the torch
backend) can agree with it by construction.

Two places follow torch.optim's implementation rather than the letter of its pseudo-code,
because the optimizer state is torch's: AMSGrad keeps the running maximum of the raw second
moment v (max_exp_avg_sq) and divides it by 1 - beta2^t afterwards; SGD's momentum buffer is
the gradient itself at t = 1.

    gradient(shape, x, dy, onehot, grad)   dW = dy^T x (+ onehot(ids)^T e) (+ grad)   [N, K]
    step(name, group, t, w, g, state)      one step at 1-based t -> (w', state')

State tensors are named as torch.optim names them (exp_avg, exp_avg_sq, max_exp_avg_sq,
momentum_buffer, square_avg, grad_avg, sum). Everything is computed in w's dtype (float64 for
the reference; float32 to measure how much fp32 rounding legitimately moves the same step).
"""
from __future__ import annotations

import math

import torch


def gradient(shape, x=None, dy=None, onehot=None, grad=None, dtype=torch.float64):
    """The full weight gradient [N, K] in dtype: dy [T, N]^T x [T, K], plus onehot(ids)^T e for
    an embedding's segment (ids [T1], -1 meaning another rank's row; e [T1, K]), plus a
    materialized gradient [N, K]. Any of the three may be absent."""
    g = torch.zeros(shape, dtype=dtype, device=(x if x is not None else grad
                                                if grad is not None else onehot[1]).device)
    if x is not None:
        g += dy.to(dtype).t() @ x.to(dtype)
    if onehot is not None:
        ids, e = onehot
        hit = ids >= 0
        g.index_add_(0, ids[hit], e[hit].to(dtype))
    if grad is not None:
        g += grad.to(dtype)
    return g


def _sgd(o, t, w, g, s):
    # torch.optim.SGD: g <- g + lambda theta; b_t = mu b_{t-1} + (1 - tau) g (b_1 = g);
    # nesterov: g <- g + mu b_t, else g <- b_t; theta <- theta - gamma g
    if o.get("weight_decay", 0.0):
        g = g + o["weight_decay"] * w
    mu = o.get("momentum", 0.0)
    if mu:
        b = g.clone() if t == 1 else mu * s["momentum_buffer"] + (1 - o.get("dampening", 0.0)) * g
        s["momentum_buffer"] = b
        g = g + mu * b if o.get("nesterov", False) else b
    return w - o["lr"] * g


def _adamw(o, t, w, g, s):
    # torch.optim.AdamW: theta <- theta - gamma lambda theta; m_t, v_t the moments;
    # m^ = m_t / (1 - beta1^t), v^ = v_t / (1 - beta2^t); theta <- theta - gamma m^ / (sqrt v^ + eps)
    b1, b2 = o["betas"]
    w = w - o["lr"] * o["weight_decay"] * w
    m = b1 * s["exp_avg"] + (1 - b1) * g
    v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    s["exp_avg"], s["exp_avg_sq"] = m, v
    if o.get("amsgrad", False):
        v = torch.maximum(s["max_exp_avg_sq"], v)
        s["max_exp_avg_sq"] = v
    m_hat = m / (1 - b1 ** t)
    v_hat = v / (1 - b2 ** t)
    return w - o["lr"] * m_hat / (torch.sqrt(v_hat) + o["eps"])


def _decay(o, w, g):
    """NAdam's and RAdam's weight decay: decoupled (theta <- theta - gamma lambda theta) or L2
    (g <- g + lambda theta)."""
    lam = o.get("weight_decay", 0.0)
    if o.get("decoupled_weight_decay", False):
        return w - o["lr"] * lam * w, g
    return w, g + lam * w


def _nadam(o, t, w, g, s):
    # torch.optim.NAdam: mu_t = beta1 (1 - 0.96^(t psi) / 2), m^ = mu_{t+1} m_t / (1 - prod_{i<=t+1}
    # mu_i) + (1 - mu_t) g / (1 - prod_{i<=t} mu_i); v^ = v_t / (1 - beta2^t)
    b1, b2 = o["betas"]
    psi = o["momentum_decay"]
    w, g = _decay(o, w, g)
    mu = [b1 * (1 - 0.5 * 0.96 ** (i * psi)) for i in range(1, t + 2)]  # mu_1 .. mu_{t+1}
    prod_t = math.prod(mu[:t])
    prod_t1 = prod_t * mu[t]
    m = b1 * s["exp_avg"] + (1 - b1) * g
    v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    s["exp_avg"], s["exp_avg_sq"] = m, v
    m_hat = mu[t] * m / (1 - prod_t1) + (1 - mu[t - 1]) * g / (1 - prod_t)
    v_hat = v / (1 - b2 ** t)
    return w - o["lr"] * m_hat / (torch.sqrt(v_hat) + o["eps"])


def _radam(o, t, w, g, s):
    # torch.optim.RAdam: rho_inf = 2 / (1 - beta2) - 1, rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t);
    # rho_t > 5: theta <- theta - gamma m^ r_t l_t, l_t = sqrt(1 - beta2^t) / (sqrt v_t + eps),
    # r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t)); else
    # theta <- theta - gamma m^
    b1, b2 = o["betas"]
    w, g = _decay(o, w, g)
    m = b1 * s["exp_avg"] + (1 - b1) * g
    v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    s["exp_avg"], s["exp_avg_sq"] = m, v
    m_hat = m / (1 - b1 ** t)
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
    if rho_t > 5:
        l_t = math.sqrt(1 - b2 ** t) / (torch.sqrt(v) + o["eps"])
        r_t = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                        / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        return w - o["lr"] * m_hat * r_t * l_t
    return w - o["lr"] * m_hat


def _lion(o, t, w, g, s):
    # Lion, Algorithm 2: c_t = beta1 m + (1 - beta1) g; theta <- theta - eta (sign(c_t) + lambda
    # theta); m <- beta2 m + (1 - beta2) g
    b1, b2 = o["betas"]
    c = b1 * s["exp_avg"] + (1 - b1) * g
    w = w - o["lr"] * (torch.sign(c) + o["weight_decay"] * w)
    s["exp_avg"] = b2 * s["exp_avg"] + (1 - b2) * g
    return w


def _rmsprop(o, t, w, g, s):
    # torch.optim.RMSprop: g <- g + lambda theta; v_t = alpha v + (1 - alpha) g^2; centered:
    # g_ave = alpha g_ave + (1 - alpha) g, v~ = v_t - g_ave^2; momentum mu > 0:
    # b_t = mu b + g / (sqrt v~ + eps), theta <- theta - gamma b_t; else theta <- theta - gamma g /
    # (sqrt v~ + eps)
    a = o["alpha"]
    if o.get("weight_decay", 0.0):
        g = g + o["weight_decay"] * w
    v = a * s["square_avg"] + (1 - a) * g * g
    s["square_avg"] = v
    if o.get("centered", False):
        ga = a * s["grad_avg"] + (1 - a) * g
        s["grad_avg"] = ga
        # from exact states v - ga^2 >= 0 stays so (it is alpha (v' - ga'^2) + alpha (1 - alpha)
        # (g - ga')^2); states handed in quantized (int8: v and ga rounded separately) can leave
        # it below 0, where the documented formula has no value: taken as 0
        v = torch.clamp(v - ga * ga, min=0.0)
    denom = torch.sqrt(v) + o["eps"]
    if o.get("momentum", 0.0):
        b = o["momentum"] * s["momentum_buffer"] + g / denom
        s["momentum_buffer"] = b
        return w - o["lr"] * b
    return w - o["lr"] * g / denom


def _adagrad(o, t, w, g, s):
    # torch.optim.Adagrad: gamma~ = gamma / (1 + (t - 1) eta); g <- g + lambda theta;
    # sum <- sum + g^2; theta <- theta - gamma~ g / (sqrt(sum) + eps)
    lr_t = o["lr"] / (1 + (t - 1) * o["lr_decay"])
    if o.get("weight_decay", 0.0):
        g = g + o["weight_decay"] * w
    s["sum"] = s["sum"] + g * g
    return w - lr_t * g / (torch.sqrt(s["sum"]) + o["eps"])


STEPS = dict(sgd=_sgd, adamw=_adamw, nadam=_nadam, radam=_radam, lion=_lion, rmsprop=_rmsprop,
             adagrad=_adagrad)


def step(name: str, group: dict, t: int, w: torch.Tensor, g: torch.Tensor, state: dict,
         grad_scale: float = 1.0):
    """One step of optimizer `name` (a key of STEPS) with torch.optim's options `group` at
    1-based step t. w, g [N, K] and the named state tensors in one dtype; grad_scale multiplies
    the gradient before anything else (what clip_grad_norm_ does to .grad before step()).
    Returns (w', state') without changing the inputs."""
    if t < 1:
        raise ValueError(f"steps are 1-based, got {t}")
    s = dict(state)
    return STEPS[name](group, t, w, g * grad_scale, s), s
