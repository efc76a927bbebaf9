"""FORGE optimizers (torch.optim's API; the first argument is the model) and their rules."""
from forge_engine.optim.base import ForgeOptimizer
from forge_engine.optim.optimizers import SGD, Adagrad, AdamW, Lion, NAdam, RAdam, RMSprop

__all__ = ["ForgeOptimizer", "AdamW", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD"]
