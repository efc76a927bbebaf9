"""Tensor and sequence parallelism: process groups, conjugate collectives, parallel layers."""
from forge_engine.parallel.layers import (ColumnParallelLinear, ParallelConfig, RowParallelLinear,
                                          VocabParallelEmbedding, default_init,
                                          vocab_parallel_cross_entropy)
from forge_engine.parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp,
                                            reduce_from_tp, reduce_scatter_to_sp, scatter_to_sp,
                                            scatter_to_tp_last)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelConfig", "default_init", "vocab_parallel_cross_entropy", "copy_to_tp",
           "reduce_from_tp", "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp",
           "gather_from_tp", "scatter_to_tp_last"]
