"""The element-wise update rules: one definition per optimizer, in two forms.

Every rule maps (w, g, s0, s1, s2) -> (w', s0', s1', s2') element by element, in fp32, where g is
the complete weight gradient of that element (docs/design.md, "The identity": the fused kernel
hands the rule a finished tile of dW = dY^T X). Because the rule is element-wise, applying it tile
by tile equals applying it to the whole tensor: this is why FORGE is exact.

Each optimizer has
  * a host function ``<name>_hparams(group, step, scalars) -> list[float]`` that folds the
    per-step scalars (lr, bias corrections, ...) into the hyperparameter vector ``hp`` of length
    HP_LEN. ``hp`` is a runtime fp32 tensor: a schedule never recompiles the kernel.
  * a torch reference ``ref_update`` branch (used by the torch backend, the tests and the
    benchmarks), and
  * a Triton ``@triton.jit`` branch in ``apply_rule`` (used inside the fused kernel).
The formulas follow torch.optim (torch 2.x single-tensor code paths); Lion follows the paper
(Chen et al. 2023, Algorithm 2). Common to all: hp[11] scales the gradient first (global-norm
clipping), hp[0] is the L2 coefficient added to it (torch's coupled ``weight_decay``), hp[1] the
decoupled decay multiplier (1 - lr * wd) applied to the weight first; each is the identity
(1.0 / 0.0 / 1.0) when unused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from forge_engine.kernels.quant import div, sqrt  # the kernels' (see there)

HP_LEN = 13
GRAD_SCALE = 11  # hp[11] multiplies the gradient first (global-norm clipping); 1.0 = off
# hp[12] holds int32 bits, not a float: the step's part of the rounding seed, added in the kernel
# to its per-weight seed argument. The seed of a step then lives in device memory with the other
# per-step values, so a captured CUDA graph replays every step with fresh random bits
# (forge_engine/graphs.py). hparams() leaves it 0; ForgeOptimizer writes it (set_seed_bits).
HP_SEED = 12

# Kind ids (constexpr in the kernel). Slot layout per kind: (state names in slot order).
SGD, SGD_MOMENTUM, ADAMW, NADAM, RADAM, LION, RMSPROP, ADAGRAD = range(8)

# VARIANT bits (constexpr: they change which state slots exist)
AMSGRAD = 1  # ADAMW: slot 2 holds max_exp_avg_sq
RMS_MOMENTUM = 1  # RMSPROP: slot 1 holds momentum_buffer
RMS_CENTERED = 2  # RMSPROP: slot 2 holds grad_avg


@dataclass(frozen=True)
class RuleSpec:
    """What the kernel needs to know about one optimizer configuration."""

    kind: int
    variant: int
    slots: tuple  # ((state name, nonnegative?) or None) for slots 0..2; None = slot unused

    @property
    def names(self) -> list:
        return [s[0] for s in self.slots if s is not None]

    @property
    def present(self) -> list:
        """Per slot 0..2: whether the rule keeps a state there (the kernels' HAS0..2)."""
        return [s is not None for s in self.slots]

    @property
    def nonneg(self) -> list:
        """Per slot 0..2: whether its state is never negative (the kernels' NN0..2)."""
        return [bool(s and s[1]) for s in self.slots]


def rule_spec(kind: int, variant: int = 0) -> RuleSpec:
    none = None
    if kind == SGD:
        slots = (none, none, none)
    elif kind == SGD_MOMENTUM:
        slots = (("momentum_buffer", False), none, none)
    elif kind == ADAMW:
        slots = (("exp_avg", False), ("exp_avg_sq", True),
                 ("max_exp_avg_sq", True) if variant & AMSGRAD else none)
    elif kind in (NADAM, RADAM):
        slots = (("exp_avg", False), ("exp_avg_sq", True), none)
    elif kind == LION:
        slots = (("exp_avg", False), none, none)
    elif kind == RMSPROP:
        slots = (("square_avg", True),
                 ("momentum_buffer", False) if variant & RMS_MOMENTUM else none,
                 ("grad_avg", False) if variant & RMS_CENTERED else none)
    elif kind == ADAGRAD:
        slots = (("sum", True), none, none)
    else:
        raise ValueError(f"unknown optimizer kind {kind}")
    return RuleSpec(kind, variant, slots)


# ---------------------------------------------------------------------------------------------
# Host side: per-step hyperparameter vectors. `step` is the 1-based step being taken; `scalars`
# is the per-parameter dict of host scalars kept in the optimizer state (NAdam's mu_product).
# ---------------------------------------------------------------------------------------------

def _decay(group, decoupled: bool):
    wd = group["weight_decay"]
    if decoupled:
        return 0.0, 1.0 - group["lr"] * wd
    return wd, 1.0


def hparams(kind: int, group: dict, step: int, scalars: dict, grad_scale: float = 1.0) -> list:
    """hp vector for one parameter at 1-based `step` (updates `scalars` in place);
    grad_scale multiplies the gradient before the rule (the clipping factor)."""
    lr = group["lr"]
    if kind == SGD:
        l2, dec = _decay(group, False)
        hp = [l2, dec, lr]
    elif kind == SGD_MOMENTUM:
        l2, dec = _decay(group, False)
        mom, damp = group["momentum"], group["dampening"]
        a, b = (0.0, 1.0) if step == 1 else (mom, 1.0 - damp)  # torch: buf = clone(g) at step 1
        hp = [l2, dec, lr, a, b, 1.0 if group["nesterov"] else 0.0, mom]
    elif kind == ADAMW:
        l2, dec = _decay(group, True)
        b1, b2 = group["betas"]
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        hp = [l2, dec, 1.0 - b1, b2, 1.0 - b2, lr / bc1, 1.0 / math.sqrt(bc2), group["eps"]]
    elif kind == NADAM:
        l2, dec = _decay(group, group["decoupled_weight_decay"])
        b1, b2 = group["betas"]
        psi = group["momentum_decay"]
        mu = b1 * (1.0 - 0.5 * 0.96 ** (step * psi))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * psi))
        scalars["mu_product"] = scalars.get("mu_product", 1.0) * mu
        mp = scalars["mu_product"]
        hp = [l2, dec, 1.0 - b1, b2, 1.0 - b2, 1.0 / (1.0 - b2 ** step), group["eps"],
              lr * (1.0 - mu) / (1.0 - mp), lr * mu_next / (1.0 - mp * mu_next)]
    elif kind == RADAM:
        l2, dec = _decay(group, group["decoupled_weight_decay"])
        b1, b2 = group["betas"]
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * step * (b2 ** step) / bc2
        if rho_t > 5.0:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                             / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            flag, r = 1.0, rect * math.sqrt(bc2)
        else:
            flag, r = 0.0, 0.0
        hp = [l2, dec, 1.0 - b1, b2, 1.0 - b2, lr / bc1, flag, r, group["eps"]]
    elif kind == LION:
        l2, dec = _decay(group, True)
        b1, b2 = group["betas"]
        hp = [l2, dec, lr, b1, 1.0 - b1, b2, 1.0 - b2]
    elif kind == RMSPROP:
        l2, dec = _decay(group, False)
        alpha = group["alpha"]
        hp = [l2, dec, lr, alpha, 1.0 - alpha, group["eps"], group["momentum"]]
    elif kind == ADAGRAD:
        l2, dec = _decay(group, False)
        clr = lr / (1.0 + (step - 1) * group["lr_decay"])
        hp = [l2, dec, clr, group["eps"]]
    else:
        raise ValueError(f"unknown optimizer kind {kind}")
    hp = hp + [0.0] * (HP_LEN - len(hp))
    hp[GRAD_SCALE] = grad_scale
    return hp


def set_seed_bits(hp: torch.Tensor, offset) -> torch.Tensor:
    """Write the step's seed offset (0 <= offset < 2**31; an int, or an int32 tensor of one per
    row of hp) into hp[..., HP_SEED] as int32 bits (hp: fp32 [..., HP_LEN] on the host, its
    rows at least HP_LEN long); returns hp."""
    hp.view(torch.int32)[..., HP_SEED] = offset
    return hp


def seed_bits(hp: torch.Tensor) -> int:
    """The seed offset set_seed_bits wrote into the fp32 vector hp [HP_LEN]."""
    return int(hp[HP_SEED:HP_SEED + 1].cpu().view(torch.int32)[0])


# ---------------------------------------------------------------------------------------------
# Torch reference: the same math as the Triton branch below, on fp32 (or fp64) tensors.
# ---------------------------------------------------------------------------------------------

def ref_update(spec: RuleSpec, hp, w, g, s):
    """Apply one step. hp: sequence of HP_LEN floats (rounded to w's dtype by the caller);
    w, g: tensors of one shape; s: list of 3 tensors or None (slots). Returns (w, s).
    Complements such as 1 - beta2 come precomputed in hp (in double on the host, as torch does):
    1 - fp32(0.999) would be off by 1e-5 relative."""
    kind, variant = spec.kind, spec.variant
    s = list(s)
    g = g * hp[GRAD_SCALE] + hp[0] * w
    w = w * hp[1]
    if kind == SGD:
        w = w - hp[2] * g
    elif kind == SGD_MOMENTUM:
        buf = hp[3] * s[0] + hp[4] * g
        d = g + hp[6] * buf if hp[5] != 0 else buf
        w = w - hp[2] * d
        s[0] = buf
    elif kind in (ADAMW, NADAM, RADAM):
        m = s[0] + hp[2] * (g - s[0])
        v = hp[3] * s[1] + hp[4] * g * g
        s[0], s[1] = m, v
        if kind == ADAMW:
            if variant & AMSGRAD:
                s[2] = torch.maximum(s[2], v)
                v = s[2]
            w = w - hp[5] * (m / (torch.sqrt(v) * hp[6] + hp[7]))
        elif kind == NADAM:
            denom = torch.sqrt(v * hp[5]) + hp[6]
            w = w - hp[7] * (g / denom)
            w = w - hp[8] * (m / denom)
        else:
            mh = m * hp[5]
            w = w - (mh * (hp[7] / (torch.sqrt(v) + hp[8])) if hp[6] != 0 else mh)
    elif kind == LION:
        c = hp[3] * s[0] + hp[4] * g
        w = w - hp[2] * torch.sign(c)
        s[0] = hp[5] * s[0] + hp[6] * g
    elif kind == RMSPROP:
        v = hp[3] * s[0] + hp[4] * g * g
        if variant & RMS_CENTERED:
            ga = s[2] + hp[4] * (g - s[2])
            # clamp: rounding (or quantized states) can push v - ga^2 below 0, torch gives NaN
            avg = torch.sqrt(torch.clamp(v - ga * ga, min=0.0)) + hp[5]
            s[2] = ga
        else:
            avg = torch.sqrt(v) + hp[5]
        if variant & RMS_MOMENTUM:
            buf = hp[6] * s[1] + g / avg
            w = w - hp[2] * buf
            s[1] = buf
        else:
            w = w - hp[2] * (g / avg)
        s[0] = v
    elif kind == ADAGRAD:
        acc = s[0] + g * g
        w = w - hp[2] * (g / (torch.sqrt(acc) + hp[3]))
        s[0] = acc
    return w, s


# ---------------------------------------------------------------------------------------------
# Triton: the same branches, resolved at compile time by the KIND / VARIANT constexprs.
# ---------------------------------------------------------------------------------------------

@triton.jit
def load_hp(hp_ptr):
    """The rules' floats hp[0] to hp[11] as a tuple, for apply_rule(..., ONCE=True): a kernel
    that applies the rule to many tiles loads them once, where apply_rule's own loads come
    again for each tile (the stores between may alias hp_ptr)."""
    return (tl.load(hp_ptr + 0), tl.load(hp_ptr + 1), tl.load(hp_ptr + 2), tl.load(hp_ptr + 3),
            tl.load(hp_ptr + 4), tl.load(hp_ptr + 5), tl.load(hp_ptr + 6), tl.load(hp_ptr + 7),
            tl.load(hp_ptr + 8), tl.load(hp_ptr + 9), tl.load(hp_ptr + 10),
            tl.load(hp_ptr + 11))


@triton.jit
def norm_factor(hp_ptr):
    """hp[GRAD_SCALE]^2: what an update multiplies a tile's squared norm by before adding it
    to sumsq, so that sumsq holds the norm of the gradient the rule applies (clipped,
    unscaled, the mean over replicas), as torch's .grad would hold it at step()."""
    gs = tl.load(hp_ptr + 11)
    return gs * gs


@triton.jit
def _hp(hp, i: tl.constexpr, ONCE: tl.constexpr):
    """hp[i]: loaded through the pointer hp, or (ONCE) taken from load_hp's tuple."""
    if ONCE:
        return hp[i]
    else:
        return tl.load(hp + i)


@triton.jit
def apply_rule(w, g, s0, s1, s2, hp, KIND: tl.constexpr, VARIANT: tl.constexpr,
               ONCE: tl.constexpr = False):
    # hp: the pointer, or (ONCE) load_hp's tuple. The gradient term and the second moment are
    # explicit fmas, the first product fused: left to LLVM's contraction, which product it
    # fuses depends on where the loads sit, and the kernels would round differently (the
    # second moment in one part of the Gluon kernel with ONCE; the gradient term in the Triton
    # kernel against the Gluon kernel's when hp[0] != 0). ONCE is taken only for
    # fused_ws.HP_ONCE_RULES, whose builds kernels/ptx_check.py --check-hp-once compares
    # (--check-kernels-agree: both kernels)
    g = tl.fma(g, _hp(hp, 11, ONCE), _hp(hp, 0, ONCE) * w)  # hp[GRAD_SCALE], hp[0]
    w = w * _hp(hp, 1, ONCE)
    if KIND == 0:  # SGD
        w = w - _hp(hp, 2, ONCE) * g
    elif KIND == 1:  # SGD_MOMENTUM
        s0 = _hp(hp, 3, ONCE) * s0 + _hp(hp, 4, ONCE) * g
        d = tl.where(_hp(hp, 5, ONCE) != 0.0, g + _hp(hp, 6, ONCE) * s0, s0)
        w = w - _hp(hp, 2, ONCE) * d
    elif KIND == 2 or KIND == 3 or KIND == 4:  # ADAMW, NADAM, RADAM share the moments
        s0 = s0 + _hp(hp, 2, ONCE) * (g - s0)
        s1 = tl.fma(_hp(hp, 3, ONCE), s1, _hp(hp, 4, ONCE) * g * g)
        if KIND == 2:
            vd = s1
            if VARIANT & 1:  # amsgrad
                s2 = tl.maximum(s2, s1)
                vd = s2
            w = w - _hp(hp, 5, ONCE) * div(s0, sqrt(vd) * _hp(hp, 6, ONCE)
                                               + _hp(hp, 7, ONCE))
        elif KIND == 3:
            denom = sqrt(s1 * _hp(hp, 5, ONCE)) + _hp(hp, 6, ONCE)
            w = w - _hp(hp, 7, ONCE) * div(g, denom)
            w = w - _hp(hp, 8, ONCE) * div(s0, denom)
        else:
            mh = s0 * _hp(hp, 5, ONCE)
            rect = mh * div(_hp(hp, 7, ONCE), sqrt(s1) + _hp(hp, 8, ONCE))
            w = w - tl.where(_hp(hp, 6, ONCE) != 0.0, rect, mh)
    elif KIND == 5:  # LION
        c = _hp(hp, 3, ONCE) * s0 + _hp(hp, 4, ONCE) * g
        sgn = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        w = w - _hp(hp, 2, ONCE) * sgn
        s0 = _hp(hp, 5, ONCE) * s0 + _hp(hp, 6, ONCE) * g
    elif KIND == 6:  # RMSPROP
        s0 = _hp(hp, 3, ONCE) * s0 + _hp(hp, 4, ONCE) * g * g
        if VARIANT & 2:  # centered
            s2 = s2 + _hp(hp, 4, ONCE) * (g - s2)
            avg = sqrt(tl.maximum(s0 - s2 * s2, 0.0)) + _hp(hp, 5, ONCE)
        else:
            avg = sqrt(s0) + _hp(hp, 5, ONCE)
        if VARIANT & 1:  # momentum
            s1 = _hp(hp, 6, ONCE) * s1 + div(g, avg)
            w = w - _hp(hp, 2, ONCE) * s1
        else:
            w = w - _hp(hp, 2, ONCE) * div(g, avg)
    elif KIND == 7:  # ADAGRAD
        s0 = s0 + g * g
        w = w - _hp(hp, 2, ONCE) * div(g, sqrt(s0) + _hp(hp, 3, ONCE))
    return w, s0, s1, s2
