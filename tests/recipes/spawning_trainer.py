"""A trainer that starts its own ranks, as TorchRec's ``benchmark_train_pipeline`` does: nothing of
the plugin in it. Each of 2 ranks (``torch.multiprocessing.spawn``) plans a small
EmbeddingBagCollection with TorchRec's ``EmbeddingShardingPlanner`` and ``get_default_sharders()``,
both bound by name at import, and prints what it planned with. A pool worker that is no TorchRec
job (a ``spawn`` context's pool) computes a sum beside them.

    python tests/recipes/spawning_trainer.py                        # stock TorchRec
    python -m torchrec_het.launch tests/recipes/spawning_trainer.py  # the plugin on every rank
"""

import multiprocessing
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

WORLD_SIZE = 2


def rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], embedding_dim=64, num_embeddings=100_000)
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=WORLD_SIZE, compute_device="cpu"), batch_size=512)
    sharders = get_default_sharders()
    plan = planner.collective_plan(ebc, sharders, dist.GroupMember.WORLD)
    (bag_sharder,) = [s for s in sharders if EmbeddingBagCollection in (s.module_type,)]
    planned = sorted({p.sharding_type for module in plan.plan.values() for p in module.values()})
    offered = sorted(bag_sharder.sharding_types("cpu"))
    line = (
        f"rank {rank} planner {type(planner).__name__} sharder {type(bag_sharder).__name__} "
        f"offers {','.join(offered)} planned {','.join(planned)}\n"
    )
    os.write(sys.stdout.fileno(), line.encode())  # one write: two ranks' lines never interleave
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(f"helper sum {pool.apply(sum, ([1, 2, 3],))}", flush=True)
    mp.spawn(rank_main, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
