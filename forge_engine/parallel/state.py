"""Process groups: torch.distributed + megatron-core's parallel_state (world = TP x DP).

init_parallel(tp) is what pretrain.py and the tests call: it initializes torch.distributed from
the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) if nobody did yet, gloo on CPU and
NCCL on GPUs, then builds megatron-core's groups and returns them, so layers receive their groups
explicitly instead of reading globals.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelGroups:
    tp_group: object
    dp_group: object
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int


# the rendezvous variables init_parallel set itself for a world of one, and what they were
# before; destroy_parallel puts them back, so a later world in this process (or a subprocess it
# starts) does not inherit the port of a group that no longer exists
_SET_BY_US: dict[str, str | None] = {}


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous nobody else chose)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tensor_parallel: int = 1, backend: str | None = None) -> ParallelGroups:
    if tensor_parallel < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tensor_parallel}")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # a plain `python pretrain.py`: a world of one, on a free port (several may run at
            # once); an address or port the user exported is kept
            world = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            world.update((k, v) for k, v in (("MASTER_ADDR", "127.0.0.1"),
                                             ("MASTER_PORT", str(free_port())))
                         if k not in os.environ)
            _SET_BY_US.update((k, os.environ.get(k)) for k in world)
            os.environ.update(world)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % tensor_parallel:
        raise ValueError(f"world size {world} is not divisible by the tensor-parallel size "
                         f"{tensor_parallel}")
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": known
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    return ParallelGroups(ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                          ps.get_tensor_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_rank(),
                          ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())


def destroy_parallel():
    import sys
    if "megatron.core.parallel_state" in sys.modules:
        ps = sys.modules["megatron.core.parallel_state"]
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in _SET_BY_US.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _SET_BY_US.clear()
