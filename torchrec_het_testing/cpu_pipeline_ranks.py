"""Rank bodies of tests/distributed/test_torchrec_pipelines_on_cpu.py.

TorchRec's train pipelines, each training a stock ``table_wise`` DLRM (TorchRec's own
``DLRMTrain``, fused row-wise Adagrad, no plugin type) for a few steps on gloo: whether each
runs on CPU with the installed TorchRec, and if not, the error it raises. The benchmark's
``--pipeline`` kinds quote those errors where they refuse a pipeline on CPU.
"""

import traceback
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torchrec
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.train_pipeline import train_pipelines
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_het import _compat
from torchrec_het.pipeline import semi_sync_pipeline_class
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

FEATURES, ROWS, BATCH, STEPS = ["user", "item"], 500, 32, 5
CPU = torch.device("cpu")


def pipelines() -> dict[str, Callable]:
    """Pipeline name -> ``make(model, optimizer, device)``, for the pipelines the installed TorchRec has."""
    made = {
        "sparse_dist": train_pipelines.TrainPipelineSparseDist,
        "semi_sync_stock": lambda m, o, d: train_pipelines.TrainPipelineSemiSync(m, o, d, start_batch=0),
        "semi_sync_adapted": lambda m, o, d: semi_sync_pipeline_class()(m, o, d, start_batch=0),
        "prefetch_sparse_dist": train_pipelines.PrefetchTrainPipelineSparseDist,
    }
    pec = _compat.pec_train_pipeline_class()
    if pec is not None:
        made["pec"] = pec
    return made


def _batches(rank: int) -> Iterator[Batch]:
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        ids = torch.randint(0, ROWS, (len(FEATURES) * BATCH,), generator=generator)
        sparse = KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, torch.ones_like(ids, dtype=torch.int32))
        labels = (ids[:BATCH] < ROWS // 5).float()
        yield Batch(dense_features=torch.rand(BATCH, 4, generator=generator), sparse_features=sparse, labels=labels)


def _table_wise_dlrm() -> tuple[torch.nn.Module, CombinedOptimizer]:
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=ROWS, feature_names=[f]) for f in FEATURES
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=4,
            dense_arch_layer_sizes=[16, 8],
            over_arch_layer_sizes=[16, 1],
        )
    )
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={t.name: table_wise(rank=i % dist.get_world_size()) for i, t in enumerate(tables)},
        world_size=dist.get_world_size(),
        device_type="cpu",
        sharder=sharder,
    )
    sharded = DistributedModelParallel(
        model, device=CPU, plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}), sharders=[sharder]
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(sharded.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    return sharded, CombinedOptimizer([sharded.fused_optimizer, dense])


def try_pipeline(make: Callable, rank: int) -> dict:
    """``{"steps": n, "losses": [...]}`` when the pipeline trains all :data:`STEPS`, else ``{"error": ..., "where": ...}``."""
    model, optimizer = _table_wise_dlrm()
    losses = []
    try:
        pipeline = make(model, optimizer, CPU)
        data = _batches(rank)
        for _ in range(STEPS):
            loss, _logits, _labels = pipeline.progress(data)  # DLRMTrain's output
            losses.append(float(loss))
    except Exception as error:  # noqa: BLE001 - what the test reads is which error, and where
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return {
            "error": f"{type(error).__name__}: {error}",
            "where": f"{frame.filename.split('site-packages/')[-1]}:{frame.name}",
        }
    return {"steps": len(losses), "losses": losses}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port):
        result = {"torchrec": torchrec.__version__}
        for name, make in pipelines().items():
            result[name] = try_pipeline(make, rank)
            dist.barrier()  # a pipeline fails alike on every rank; none starts the next model early
        write_rank_result(out_dir, rank, result)
