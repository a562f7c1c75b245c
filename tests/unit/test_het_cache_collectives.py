"""Every collective of ``het_cached_row_wise`` is issued by its dists (TorchRec's grammar).

The modules of ``torchrec_het/sharding/het_cache/`` are read with ``ast`` (nothing is imported):
only ``dists.py`` may call a ``torch.distributed`` collective or import one of the plugin's
exchange helpers (:mod:`torchrec_het.sharding.common.exchange`, :mod:`~torchrec_het.sharding.common.counts`);
the lookup, the protocol, the pushes and the cache state are local compute.
"""

import ast
from pathlib import Path

HET_CACHE = Path(__file__).resolve().parents[2] / "torchrec_het" / "sharding" / "het_cache"
DISTS = "dists.py"
COLLECTIVES = {
    "all_to_all",
    "all_to_all_single",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "scatter",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
    "all_reduce_coalesced",
    "all_gather_coalesced",
}
EXCHANGE_MODULES = ("torchrec_het.sharding.common.exchange",)
COLLECTIVE_FREE = {"Exchange"}  # a type, not a call: what an exchange started elsewhere returns


def collective_uses(source: str) -> list[str]:
    """``line: what`` for each torch.distributed collective a module's code reaches, and each
    exchange helper it imports."""
    tree = ast.parse(source)
    dist_names = {"torch.distributed"}  # names bound to the torch.distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    dist_names.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                dist_names.update(a.asname or a.name for a in node.names if a.name == "distributed")
            for alias in node.names:
                if node.module == "torch.distributed" and alias.name in COLLECTIVES:
                    found.append(f"{node.lineno}: from torch.distributed import {alias.name}")
                if node.module in EXCHANGE_MODULES and alias.name not in COLLECTIVE_FREE:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) in dist_names:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_collectives() -> None:
    source = (
        "import torch.distributed as d\nimport torch\nfrom torch import distributed\n"
        "from torchrec_het.sharding.common.exchange import exchange_flat, Exchange\n"
        "d.all_to_all_single(a, b)\ntorch.distributed.all_reduce(x)\ndistributed.barrier()\n"
        "torch.gather(x, 0, i)\nx.scatter_(0, i, y)\n"
    )
    assert collective_uses(source) == [
        "4: from torchrec_het.sharding.common.exchange import exchange_flat",
        "5: d.all_to_all_single",
        "6: torch.distributed.all_reduce",
        "7: distributed.barrier",
    ]


def test_only_the_dists_issue_collectives() -> None:
    modules = sorted(HET_CACHE.glob("*.py"))
    assert {p.name for p in modules} >= {DISTS, "lookup.py", "pushes.py", "protocol.py"}
    assert collective_uses((HET_CACHE / DISTS).read_text()), "the scan finds nothing in dists.py: it is blind"
    offenders = [
        f"{path.name}:{use}" for path in modules if path.name != DISTS for use in collective_uses(path.read_text())
    ]
    assert not offenders, "collectives outside het_cache/dists.py:\n" + "\n".join(offenders)
