"""Run a function on R CPU ranks with gloo process groups (torch.multiprocessing).

run_ranks(fn, R, *args) calls fn(rank, R, *args) in R processes after init_process_group, and
returns the list of what each rank returned (torch.save-able). A failure on any rank fails the
test with that rank's traceback. Ranks fork from a forkserver (see _PRELOAD).
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forge_engine.parallel.state import free_port


def _entry(rank, world, port, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        from forge_engine.parallel.state import destroy_parallel
        destroy_parallel()


# Ranks fork from a forkserver: a clean process that imported these modules once and never ran
# a collective. Forking the test process itself deadlocked or crashed in megatron-core's group
# set-up (it inherits process groups that in-process pretrain runs created and destroyed, their
# threads, garbage of tensor subclasses); spawning a fresh interpreter per rank is safe too but
# pays the imports of torch, megatron-core and forge_engine on every rank of every test.
_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "forge_engine",
            "forge_engine.optim", "forge_engine.model", "forge_engine.parallel",
            "forge_engine.kernels.fused_update"]
mp.set_forkserver_preload(_PRELOAD)


def run_ranks(fn, world, *args):
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args), nprocs=world,
                           join=True, start_method="forkserver")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def tp_group_all():
    """The whole world as the TP group (tests use world == TP size)."""
    return dist.new_group(list(range(dist.get_world_size())))
