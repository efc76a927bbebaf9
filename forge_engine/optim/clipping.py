"""The arithmetic of gradient clipping: squared norms of gradient lists and the scaling of
gradients by a clip factor, formed the same way by ForgeOptimizer, Engine and graphs.py."""
from __future__ import annotations

import torch


def scale_grad_(g: torch.Tensor, factor) -> torch.Tensor:
    """g *= factor in place (a clip factor: a float, or a 0-d fp32 device tensor in a captured
    step), the product formed in fp32 and rounded once to g's dtype, whichever the factor is.
    A Python float factor does that already. A 0-d tensor factor does not, on CUDA: a 0-d operand
    takes no part in type promotion, so a bf16 gradient times a 0-d fp32 CUDA factor computes
    with the factor rounded to bf16 (CPU kernels keep it as a scalar); on the H200 that made a
    captured clipped step differ from the eager one. As a one-element
    tensor it takes part: the common dtype is fp32, and the result is rounded to g's dtype."""
    if not torch.is_tensor(factor):
        return g.mul_(factor)
    (g.view(1) if g.dim() == 0 else g).mul_(factor.reshape(1))
    return g


def scale_grads_(params, factor) -> None:
    """scale_grad_ on the .grad of every parameter that has one: the clip of the gradients
    that exist as tensors (Engine's torch path, graphs.device_step, the standard path of
    ForgeOptimizer.scale_gradients)."""
    for p in params:
        if p.grad is not None:
            scale_grad_(p.grad, factor)


def sumsq_all(grads, device) -> torch.Tensor:
    """The sum of ||g||^2 over a list of gradients, a 0-d tensor on `device` (fp32, or fp64
    with fp64 gradients): one foreach norm per device and dtype, accumulated in at least fp32
    (torch.nn.utils.clip_grad_norm_'s way) and without an fp32 copy of any gradient, where
    one norm per gradient took a reduction, a square and an add each: 585 kernels for
    Llama-3.1-8B's 195 gradients."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (_, dtype), gs in groups.items():
        norms = torch._foreach_norm(gs, 2, dtype=torch.promote_types(dtype, torch.float32))
        total = total + torch.stack(norms).square().sum().to(device)
    return total
