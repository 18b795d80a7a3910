"""Training on several processes (torchrun, DistributedDataParallel). Plain `python train.py` is
rank 0 of 1. Under torchrun (WORLD_SIZE > 1) every process joins a process group; rank 0 converts
the model and builds the data while the others wait at a barrier, then they find both on disk.
Each rank trains on its share of the batches (batches.Plan), DDP averages the gradients in the
backward pass, and rank 0 alone evaluates, saves and prints (session.Session).

    rank, world, device = init_distributed("auto")
    forward = wrap(losses.TrainForward(heads), world)

Tests: tests/test_train.py, tests/test_train_cli.py (two CPU processes, gloo).
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn


def init_distributed(device):
    """Returns (rank, world size, torch.device). Under torchrun: NCCL and one GPU per rank
    (LOCAL_RANK) on CUDA, gloo on CPU."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    # a long timeout: the other ranks wait at the first barrier while rank 0 builds the data
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=12)
    )
    return dist.get_rank(), world, torch.device(device)


def rank_and_world():
    """(rank, world size) of this process: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wrap(forward, world):
    """The loss module, wrapped so that its backward averages the gradients over the ranks; the
    frozen shared buffers are never sent. As it is with one process."""
    if world == 1:
        return forward
    # (torch 2.13 calls broadcast_buffers deprecated; its replacement would still copy them once)
    return nn.parallel.DistributedDataParallel(forward, broadcast_buffers=False)


def total(n, device, world, op=None):
    """n (an int) summed over the ranks, or combined by `op` (dist.ReduceOp.MAX, say)."""
    t = torch.tensor([n], device=device)
    if world > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return int(t)


def barrier(world):
    if world > 1:
        dist.barrier()


def share(values, world):
    """Rank 0's list `values` sent to every rank, in place."""
    if world > 1:
        dist.broadcast_object_list(values, src=0)


def leave(world):
    """The process group's end, once this rank is done."""
    if world > 1:
        dist.destroy_process_group()
