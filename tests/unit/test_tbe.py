"""``torchrec_het._tbe``: the one module that touches FBGEMM's internals.

The scan (:func:`scan`) reads each file's syntax tree and flags what only ``_tbe.py`` may do:
import ``fbgemm_gpu`` (or call ``torch.ops.fbgemm``), read a table-batched kernel's optimizer
attributes or its name expression (``getattr(x.optimizer, "value", ...)``), its table specs or
buffers (attributes and names such as ``momentum1_physical_offsets``, ``weights_host``).
Then every accessor of ``_tbe`` is checked against a real FBGEMM kernel.
"""

import ast
import re
from pathlib import Path

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from torchrec_het import _tbe

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("torchrec_het", "sharders", "recipes", "torchrec_het_bench")
# _tbe itself; and tbe_cost, the benchmark that times FBGEMM's own kernel on each stack (it builds one
# with FBGEMM's public constructor and reads its version, no internals of a kernel the plugin uses)
EXCLUDED = ("torchrec_het/_tbe.py", "torchrec_het_bench/tbe_cost.py")
# a table-batched kernel's attributes the plugin reads only through _tbe
KERNEL_ATTRIBUTES = {
    "optimizer_args",
    "learning_rate_tensor",
    "embedding_specs",
    "feature_table_map",
    "weights_precision",
    "split_optimizer_states",
    "pooling_mode",
}
BUFFER_NAME = re.compile(
    r"^(weights|momentum1|momentum2)(_(dev|host|uvm|physical_offsets|physical_placements|offsets|placements))?$"
)


def _is_optimizer_value(node: ast.AST) -> bool:
    """``x.optimizer.value`` or ``getattr(x.optimizer, "value", ...)``: the optimizer-name expression."""
    if isinstance(node, ast.Attribute) and node.attr == "value":
        return isinstance(node.value, ast.Attribute) and node.value.attr == "optimizer"
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) > 1
    ):
        target, name = node.args[0], node.args[1]
        return (
            isinstance(target, ast.Attribute)
            and target.attr == "optimizer"
            and isinstance(name, ast.Constant)
            and name.value == "value"
        )
    return False


def scan(source: str, path: str = "<source>") -> list[tuple[str, int, str]]:
    """(path, line, what) of each FBGEMM internal ``source`` touches."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (path, node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "fbgemm_gpu"
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fbgemm_gpu":
            found.append((path, node.lineno, f"from {node.module} import ..."))
        elif _is_optimizer_value(node):
            found.append((path, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute):
            if node.attr in KERNEL_ATTRIBUTES or BUFFER_NAME.match(node.attr) and node.attr != "weights":
                found.append((path, node.lineno, f".{node.attr}"))
            elif node.attr == "fbgemm" and ast.unparse(node.value) == "torch.ops":
                found.append((path, node.lineno, "torch.ops.fbgemm"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and BUFFER_NAME.match(node.value):
            if node.value != "weights":  # a word of its own; the buffers' names are _tbe.WEIGHTS / _tbe.STATE there
                found.append((path, node.lineno, repr(node.value)))
    return found


SAMPLE = """
import fbgemm_gpu
from fbgemm_gpu.split_embedding_configs import EmbOptimType


def touch(tbe, sharded):
    name = str(getattr(tbe.optimizer, "value", tbe.optimizer)).lower()
    eps = tbe.optimizer_args.eps
    rows = getattr(tbe, "momentum1_physical_offsets"), tbe.weights_host, tbe.optimizer.value
    torch.ops.fbgemm.dense_embedding_codegen_lookup_function
    return sharded.optimizer.step(), sharded.weights, {"weights": 1}
"""


def test_the_scan_finds_each_kind_of_access() -> None:
    found = {(line, what) for _, line, what in scan(SAMPLE)}
    assert found == {
        (2, "import fbgemm_gpu"),
        (3, "from fbgemm_gpu.split_embedding_configs import ..."),
        (7, "getattr(tbe.optimizer, 'value', tbe.optimizer)"),
        (8, ".optimizer_args"),
        (9, "'momentum1_physical_offsets'"),
        (9, ".weights_host"),
        (9, "tbe.optimizer.value"),
        (10, "torch.ops.fbgemm"),
    }, sorted(found)


def test_only_tbe_touches_fbgemm_internals() -> None:
    files = {str(p.relative_to(ROOT)): p for root in SCANNED for p in sorted((ROOT / root).rglob("*.py"))}
    assert "torchrec_het/sharding/het_cache/lookup.py" in files and "torchrec_het/_tbe.py" in files
    found = [hit for path, file in files.items() if path not in EXCLUDED for hit in scan(file.read_text(), path)]
    assert not found, "route these through torchrec_het/_tbe.py:\n" + "\n".join(f"{p}:{n}: {w}" for p, n, w in found)


# ---- every accessor reaches a real FBGEMM kernel ---------------------------------------------------


def _kernel(optimizer: EmbOptimType, **kwargs) -> SplitTableBatchedEmbeddingBagsCodegen:
    specs = [(5, 4, EmbeddingLocation.HOST, ComputeDevice.CPU), (7, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=optimizer, learning_rate=0.25, device=torch.device("cpu"), **kwargs
    )


def test_optimizer_accessors() -> None:
    tbe = _kernel(EmbOptimType.EXACT_ROWWISE_ADAGRAD, eps=1e-5)
    assert _tbe.optimizer_name(tbe) == "exact_row_wise_adagrad" and _tbe.optimizer_kind(tbe) == "rowwise_adagrad"
    assert _tbe.replica_kind(tbe) == "rowwise_adagrad" and _tbe.accumulates_squares(tbe)
    assert _tbe.optimizer_eps(tbe) == 1e-5 and float(_tbe.learning_rate(tbe)) == 0.25 and _tbe.num_tables(tbe) == 2
    sgd = _kernel(EmbOptimType.EXACT_SGD)
    assert _tbe.optimizer_kind(sgd) == "sgd" and not _tbe.accumulates_squares(sgd)
    decayed = _kernel(EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1)
    try:
        _tbe.replica_kind(decayed)
    except ValueError as error:
        assert "weight decay" in str(error)
    else:
        raise AssertionError("replica_kind took a kernel with weight decay")


def test_buffer_accessors() -> None:
    tbe = _kernel(EmbOptimType.EXACT_ADAGRAD)
    attribute, offsets = _tbe.flat_buffer(tbe, _tbe.WEIGHTS)
    assert attribute == "weights_host" and offsets.tolist() == [0, 20]
    assert _tbe.buffer(tbe, attribute) is tbe.weights_host
    state, state_offsets = _tbe.flat_data(tbe, _tbe.STATE)
    assert state.numel() == 5 * 4 + 7 * 8 and state_offsets.tolist() == [0, 20]
    weights, state = _tbe.row_state(tbe, 1)
    assert weights.shape == (7, 8) and state.shape == (7, 8)
    layout = _tbe.kernel_layout(tbe)
    assert layout is not None and layout.kind == "adagrad" and layout.dims == (4, 8)
