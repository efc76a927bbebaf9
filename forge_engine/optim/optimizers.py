"""The user-facing optimizers: torch.optim's names, arguments and defaults, FORGE inside.

    opt = forge_engine.optim.AdamW(model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

The first argument is the model. Extra keywords of every class:
    state_dtype          "fp32" | "bf16" | "int8" (default: fp32 for fp32 weights, bf16 for bf16)
    stochastic_rounding  round bf16 weights / bf16 states stochastically (default True)
    seed                 seed of the rounding streams (default: torch.initial_seed())
torch.optim options that change the implementation, not the math (foreach, fused) are accepted
and ignored; options we do not implement (maximize, capturable, differentiable) raise ValueError.
"""
from __future__ import annotations

from forge_engine.kernels import rules as R
from forge_engine.optim.base import ForgeOptimizer


def _unsupported(cls: str, **opts):
    for name, val in opts.items():
        if val:
            raise ValueError(f"{cls}: {name}=True is not supported by forge_engine; use "
                             f"torch.optim.{cls} for it")


def _check(cls: str, lr=0.0, eps=0.0, weight_decay=0.0, betas=(0.0, 0.0)):
    if not lr >= 0.0:
        raise ValueError(f"{cls}: invalid learning rate {lr} (must be >= 0)")
    if not eps >= 0.0:
        raise ValueError(f"{cls}: invalid eps {eps} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"{cls}: invalid weight_decay {weight_decay} (must be >= 0)")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{cls}: invalid beta parameter at index {i}: {b} (need 0 <= b < 1)")


class AdamW(ForgeOptimizer):
    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, **forge):
        _unsupported("AdamW", maximize=maximize, capturable=capturable,
                     differentiable=differentiable)
        _check("AdamW", lr, eps, weight_decay, betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad))
        super().__init__(model, defaults, R.ADAMW, R.AMSGRAD if amsgrad else 0, **forge)


class NAdam(ForgeOptimizer):
    def __init__(self, model, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 momentum_decay=4e-3, decoupled_weight_decay=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, **forge):
        _unsupported("NAdam", maximize=maximize, capturable=capturable,
                     differentiable=differentiable)
        _check("NAdam", lr, eps, weight_decay, betas)
        if not momentum_decay >= 0.0:
            raise ValueError(f"NAdam: invalid momentum_decay {momentum_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        momentum_decay=momentum_decay,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(model, defaults, R.NADAM, 0, **forge)


class RAdam(ForgeOptimizer):
    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False,
                 capturable=False, differentiable=False, **forge):
        _unsupported("RAdam", maximize=maximize, capturable=capturable,
                     differentiable=differentiable)
        _check("RAdam", lr, eps, weight_decay, betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(model, defaults, R.RADAM, 0, **forge)


class Lion(ForgeOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2):
        c = b1 m + (1 - b1) g ;  w <- w (1 - lr wd) - lr sign(c) ;  m <- b2 m + (1 - b2) g
    Defaults as the paper recommends: betas (0.9, 0.99), lr 3-10x smaller than AdamW's."""

    def __init__(self, model, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **forge):
        _check("Lion", lr, 0.0, weight_decay, betas)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(model, defaults, R.LION, 0, **forge)


class RMSprop(ForgeOptimizer):
    def __init__(self, model, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                 centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, **forge):
        _unsupported("RMSprop", maximize=maximize, capturable=capturable,
                     differentiable=differentiable)
        _check("RMSprop", lr, eps, weight_decay)
        if not momentum >= 0.0:
            raise ValueError(f"RMSprop: invalid momentum value {momentum}")
        if not alpha >= 0.0:
            raise ValueError(f"RMSprop: invalid alpha value {alpha}")
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=bool(centered))
        variant = (R.RMS_MOMENTUM if momentum > 0 else 0) | (R.RMS_CENTERED if centered else 0)
        super().__init__(model, defaults, R.RMSPROP, variant, **forge)


class Adagrad(ForgeOptimizer):
    def __init__(self, model, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=False, differentiable=False, fused=None,
                 **forge):
        _unsupported("Adagrad", maximize=maximize, differentiable=differentiable)
        _check("Adagrad", lr, eps, weight_decay)
        if not lr_decay >= 0.0:
            raise ValueError(f"Adagrad: invalid lr_decay value {lr_decay}")
        if not initial_accumulator_value >= 0.0:
            raise ValueError(f"Adagrad: invalid initial_accumulator_value "
                             f"{initial_accumulator_value}")
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(model, defaults, R.ADAGRAD, 0, **forge)


class SGD(ForgeOptimizer):
    """SGD; with momentum > 0 it is the eighth optimizer, SGD-momentum (nesterov supported)."""

    def __init__(self, model, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False, foreach=None, differentiable=False, fused=None, **forge):
        _unsupported("SGD", maximize=maximize, differentiable=differentiable)
        _check("SGD", lr, 0.0, weight_decay)
        if not momentum >= 0.0:
            raise ValueError(f"SGD: invalid momentum value {momentum}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=bool(nesterov))
        kind = R.SGD_MOMENTUM if momentum > 0 else R.SGD
        super().__init__(model, defaults, kind, 0, **forge)


__all__ = ["AdamW", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD"]
