"""Benchmark configurations of ``het_cached_row_wise``: staleness bounds x capacity x protocol."""

from torchrec.distributed.sharding_plan import construct_module_sharding_plan

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise
from torchrec_het_bench.config_types import BenchConfig

BOUNDS = (0, 2, 10, 100)
CAPACITIES = (0.01, 0.1)
PROTOCOLS = ("het", "lease")


def plan_every_table(generator):
    """A ``make_plan`` that gives every table of the module the sharding ``generator()`` makes."""

    def make_plan(module, tables, sharder, world_size: int):
        return construct_module_sharding_plan(
            module,
            per_param_sharding={t.name: generator() for t in tables},
            world_size=world_size,
            device_type="cpu",
            sharder=sharder,
        )

    return make_plan


_all_het = plan_every_table(het_cached_row_wise)


def het_config_name(s: int, capacity: float, protocol: str, policy: str = "lru") -> str:
    suffix = "" if policy == "lru" else f"_{policy}"
    return f"het_{protocol}_s{s}_c{round(capacity * 100)}{suffix}"


def het_configs() -> list[BenchConfig]:
    """Every combination of bound, capacity, protocol and policy, for the registry
    (:func:`torchrec_het_bench.configs.all_configs`)."""
    configs = []
    for protocol in PROTOCOLS:
        for capacity in CAPACITIES:
            for s in BOUNDS:
                for policy in ("lru", "lfu"):
                    settings = CacheSettings(s_read=s, s_write=s, capacity=capacity, policy=policy, protocol=protocol)
                    name = het_config_name(s, capacity, protocol, policy)
                    configs.append(
                        BenchConfig(
                            name=name,
                            stock=False,
                            description=f"HET cache, {protocol}, s_read=s_write={s}, {capacity:.0%} of rows, {policy}",
                            make_sharders=lambda settings=settings: [
                                HetEmbeddingBagCollectionSharder(cache=HetCacheConfig(default=settings))
                            ],
                            make_constraints=lambda tables, preset: None,
                            params={
                                "sharding": "het_cached_row_wise",
                                "s_read": s,
                                "s_write": s,
                                "capacity": capacity,
                                "protocol": protocol,
                                "policy": policy,
                            },
                            make_plan=_all_het,
                        )
                    )
    return configs
