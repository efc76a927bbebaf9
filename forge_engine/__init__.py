"""forge_engine: a Megatron-style LLM training engine built on FORGE (Fused On-Register Gradient
Elimination): every linear weight is updated inside backward by one Triton kernel that
accumulates its gradient tile in registers and applies the optimizer there. See docs/design.md."""
from forge_engine import optim
from forge_engine.linear import ForgeLinear

__version__ = "0.1.0"
__all__ = ["optim", "ForgeLinear", "__version__"]
