"""Run a function on R CPU ranks with gloo process groups (torch.multiprocessing).

run_ranks(fn, R, *args) calls fn(rank, R, *args) in R processes after init_process_group, and
returns the list of what each rank returned (torch.save-able). A failure on any rank fails the
test with that rank's traceback. fork is used on CPU (fast); spawn where CUDA exists.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forge_engine.parallel.state import free_port


def _entry(rank, world, port, outdir, fn, args):
    # a forked rank never collects what it inherited: the parent owns those objects (tensor
    # subclasses among them), and collecting the parent's garbage in the child can crash
    gc.freeze()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        from forge_engine.parallel.state import destroy_parallel
        destroy_parallel()


def run_ranks(fn, world, *args):
    with tempfile.TemporaryDirectory() as outdir:
        # fork is fast, but a forked child cannot use CUDA once a GPU machine's parent (or a
        # library in the child, such as RNG capture) has touched it: spawn wherever CUDA exists
        method = "spawn" if torch.cuda.is_available() else "fork"
        gc.collect()  # the children start from a parent without garbage
        mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args), nprocs=world,
                           join=True, start_method=method)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def tp_group_all():
    """The whole world as the TP group (tests use world == TP size)."""
    return dist.new_group(list(range(dist.get_world_size())))
