"""Which of a sharder's quantized-comms codecs each sharding type's embeddings take, priced.

A sharder's ``qcomm_codecs_registry`` (TorchRec's ``get_qcomm_codecs_registry(QCommsConfig(...))``)
holds the codecs of three collectives; each type's embeddings travel by one of them, the forward
codec on the embeddings, the backward codec on their gradients (:func:`comm_op`):

- ``table_wise``, ``column_wise``, ``table_column_wise`` bags: ``POOLED_EMBEDDINGS_ALL_TO_ALL``;
- ``row_wise``, ``table_row_wise`` bags: ``POOLED_EMBEDDINGS_REDUCE_SCATTER``;
- every sequence sharding, ``het_row_replicated``'s too: ``SEQUENCE_EMBEDDINGS_ALL_TO_ALL``;
- ``het_row_replicated`` bags (partial sums) and ``het_cached_row_wise`` (rows fetched, gradients
  pushed): ``POOLED_EMBEDDINGS_ALL_TO_ALL``
  (:mod:`torchrec_het.sharding.common.wire_codec`);
- ``data_parallel``: none (its all-reduce is not quantized);
- ``het_row_replicated``'s replica syncs sum gradients in the summing dtype of the registry
  (:func:`~torchrec_het.sharding.common.wire_codec.summing_dtype`: the backward codec of
  ``POOLED_EMBEDDINGS_REDUCE_SCATTER`` when fp16 or bf16, else fp32), their touch counts in fp32.

Codec CPU (encoding on the sender, decoding on the receiver) is priced per element as measured
on this machine (:meth:`~torchrec_het.sharding.common.wire_codec.WireCodec.seconds_per_element`).

Bytes per element are the wire's, block scales included
(:meth:`~torchrec_het.sharding.common.wire_codec.WireCodec.bytes_per_element`): INT8 row-wise
prices ``(row_dim + 8) / row_dim`` where TorchRec's estimator prices 1 byte (the quantized dtype's
size), MX4 ``0.5 + 1 / group`` where it prices 1; fp16 and bf16 price 2 in both.
"""

import torch
from torch import nn
from torchrec.distributed.types import CommOp
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_het.planner.traffic import FLOAT, FP32, WirePrecision
from torchrec_het.sharding.common.wire_codec import codecs_of, summing_dtype
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

REDUCE_SCATTER_TYPES = ("row_wise", "table_row_wise")
ALL_TO_ALL_TYPES = ("table_wise", "column_wise", "table_column_wise", HET_ROW_REPLICATED, HET_CACHED_ROW_WISE)


def comm_op(sharding_type: str, pooled: bool = True) -> CommOp | None:
    """The collective whose codecs ``sharding_type``'s embeddings take (None: not quantized)."""
    if sharding_type == HET_CACHED_ROW_WISE:
        return CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
    if sharding_type not in REDUCE_SCATTER_TYPES + ALL_TO_ALL_TYPES:
        return None
    if not pooled:
        return CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL
    if sharding_type in REDUCE_SCATTER_TYPES:
        return CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
    return CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL


def wire_precision(registry: dict | None, sharding_type: str, pooled: bool = True) -> WirePrecision:
    """Wire bytes per element of ``sharding_type``'s embeddings, their gradients and (row
    replication) its synced gradients under ``registry`` (a sharder's ``qcomm_codecs_registry``; None: fp32)."""
    op = comm_op(sharding_type, pooled)
    if op is None or not registry:
        return FP32
    codecs = codecs_of(registry, op)
    forward, backward = codecs.forward.bytes_per_element(), codecs.backward.bytes_per_element()
    cpu = codecs.forward.seconds_per_element(), codecs.backward.seconds_per_element()
    return WirePrecision(forward, backward, _sync_bytes(registry, sharding_type), *cpu)


def _sync_bytes(registry: dict, sharding_type: str) -> float:
    """Bytes of a gradient value row replication's replica syncs sum (its summing dtype; other types sync nothing)."""
    if sharding_type != HET_ROW_REPLICATED:
        return float(FLOAT)
    return float(torch.empty(0, dtype=summing_dtype(registry)).element_size())


def sharder_registry(sharders: list | None, pooled: bool = True) -> dict | None:
    """The ``qcomm_codecs_registry`` of the sharder among ``sharders`` that shards bags
    (``EmbeddingBagCollection``, ``pooled``) or sequences (``EmbeddingCollection``); None: none."""
    base: type[nn.Module] = EmbeddingBagCollection if pooled else EmbeddingCollection
    for sharder in sharders or ():
        if issubclass(sharder.module_type, base):
            return getattr(sharder, "qcomm_codecs_registry", None)
    return None
