import torch
from tests.dist import test_grpo_archs as t


def worker(rank, world, dirs, out):
    results = {kind: t._step(path, 1, world, 1) for kind, path in dirs.items()}
    if world == 2:
        results.update({f"{kind}/ep2": t._step(dirs[kind], 2, 1, 2) for kind in dirs})
    if rank == 0:
        torch.save(results, out)
