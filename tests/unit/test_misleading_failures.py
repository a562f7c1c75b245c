"""Issue 19's "Failures that mislead", the cases one process can show: each works as TorchRec does,
or fails at once with one message naming the table or feature, what is unsupported and what to
do instead. (The cases that need ranks: tests/distributed/test_misleading_failures.py.)"""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.errors import ConfigurationError
from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.sharders import get_het_sharders
from torchrec_het.sharding.common.cache_stats import GroupStats
from torchrec_het.sharding.common.validate import FeatureCheck

ROWS = {"user": 10, "item": 5}


def _kjt(keys, values, lengths, **kwargs) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths), **kwargs)


# --- keys a module does not own -------------------------------------------------------------------


def test_a_module_ignores_keys_it_does_not_own_but_not_its_own_missing_or_reordered() -> None:
    check = FeatureCheck({"item": 5})
    check(_kjt(["user", "item"], [-7, 99, 4], [1, 1, 1, 0]))  # 'user' is another module's: any ids
    with pytest.raises(ValueError, match=r"feature 'item': id 5 outside its table's rows \[0, 5\)"):
        check(_kjt(["user", "item"], [0, 5], [1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"feature key\(s\) \['item'\] missing from the batch"):
        check(_kjt(["user"], [0], [1, 0]))
    with pytest.raises(ValueError, match=r"differ from the first batch's \['user', 'item'\]"):
        check(_kjt(["item", "user"], [0, 1], [1, 0, 1, 0]))  # TorchRec's input dist fixed the order


# --- a batch size per feature (VBE) ---------------------------------------------------------------


def _vbe() -> KeyedJaggedTensor:
    """'user' with 4 bags, 'item' with 2."""
    return _kjt(["user", "item"], [1, 2, 3, 4, 0, 1], [1, 1, 1, 1, 1, 1], stride_per_key_per_rank=[[4], [2]])


def test_vbe_is_refused_naming_the_feature_table_and_type() -> None:
    check = FeatureCheck(ROWS, {"item": "table 't_item' (het_cached_row_wise)"})
    with pytest.raises(ValueError) as raised:
        check(_vbe())
    message = str(raised.value)
    for needed in ("feature(s) ['item']", "VBE", "stride_per_key_per_rank", "{'user': 4, 'item': 2}",
                   "table 't_item' (het_cached_row_wise) cannot take", "give every feature the batch's size",
                   "sharding_types=['row_wise']"):  # fmt: skip
        assert needed in message, (needed, message)


def test_vbe_reaching_only_stock_tables_of_the_module_is_checked_and_taken() -> None:
    check = FeatureCheck(ROWS, {"other": "table 't_other' (het_cached_row_wise)"})
    check(_vbe())
    with pytest.raises(ValueError, match="feature 'item': id 7"):
        check(_kjt(["user", "item"], [1, 2, 3, 4, 0, 7], [1, 1, 1, 1, 1, 1], stride_per_key_per_rank=[[4], [2]]))


# --- the planner's reasons ------------------------------------------------------------------------


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=100, feature_names=["user"])],
            device=meta,
        )
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="t_item", embedding_dim=8, num_embeddings=100, feature_names=["item"])],
            device=meta,
        )
        weighted = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t_pos", embedding_dim=8, num_embeddings=100, feature_names=["pos"])],
            is_weighted=True, device=meta,
        )  # fmt: skip
        self.fp = FeatureProcessedEmbeddingBagCollection(weighted, PositionWeightedModuleCollection({"pos": 4}))


def _profile() -> AccessProfile:
    counts = tuple(torch.arange(100, 0, -1, dtype=torch.int64) for _ in range(3))
    return AccessProfile(("t_user", "t_item", "t_pos"), (100, 100, 100), counts, 4)


def _plan(constraints: dict[str, list[str]]):
    planner = HetEmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), batch_size=8,
        constraints={n: ParameterConstraints(sharding_types=t) for n, t in constraints.items()},
        pricing=PluginPricing(AccessModel(_profile(), source="profile.pt")),
    )  # fmt: skip
    profile = _profile()
    return planner.plan(_Model(), get_het_sharders(profile=profile))


def test_the_cache_forced_on_a_sequence_table_says_it_supports_bags_only() -> None:
    # the profile names t_item: the message used to blame het_row_replicated's missing profile
    with pytest.raises(ValueError) as raised:
        _plan({"t_item": ["het_cached_row_wise"]})
    message = str(raised.value)
    assert "table 't_item'" in message and "het_cached_row_wise supports EmbeddingBagCollection tables only" in message
    assert "EmbeddingCollection" in message and "het_row_replicated needs" not in message, message
    assert message.endswith("or the plugin's het_row_replicated)"), message  # the plugin type it does support


def test_a_feature_processed_tables_suggestion_names_no_plugin_type() -> None:
    with pytest.raises(ValueError) as raised:
        _plan({"t_pos": ["het_row_replicated"]})
    assert "or the plugin's" not in str(raised.value), str(raised.value)  # it supports none of them


@pytest.mark.parametrize("types", [["het_cached_row_wise"], ["het_row_replicated"]])
def test_a_plugin_type_constrained_on_a_feature_processed_table_raises_naming_table_and_type(types) -> None:
    with pytest.raises(ValueError) as raised:
        _plan({"t_pos": types})  # it used to be planned row_wise without a word
    message = str(raised.value)
    assert "table 't_pos'" in message and f"{types[0]} supports" in message, message
    assert "FeatureProcessedEmbeddingBagCollection" in message and "constrain it to a type" in message, message


def test_a_feature_processed_table_keeps_the_stock_types_its_constraints_also_allow() -> None:
    plan = _plan({"t_pos": ["het_cached_row_wise", "table_wise"]})  # TorchRec: the allowed types it can build
    assert plan.plan["fp"]["t_pos"].sharding_type == "table_wise"


# --- a profile that does not fit the model --------------------------------------------------------


@pytest.mark.parametrize(
    "profile, mismatch",
    [
        (AccessProfile(("other",), (100,), (torch.ones(100, dtype=torch.int64),), 1), "names none of the model's tables"),
        (AccessProfile(("t_user",), (7,), (torch.ones(7, dtype=torch.int64),), 1),
         "counts other row numbers than the model's tables: [\"'t_user' has 7 rows in the profile, 100 in the model\"]"),
    ],
)  # fmt: skip
def test_a_profile_that_does_not_fit_the_model_fails_every_rank_before_any_collective(profile, mismatch) -> None:
    access = AccessModel(profile, source="/p/profile.pt", origin="TORCHREC_HET_PROFILE")
    planner = HetEmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), pricing=PluginPricing(access)
    )
    # no process group exists here: collective_plan fails on the profile before it needs one
    with pytest.raises(ConfigurationError) as raised:
        planner.collective_plan(_Model(), get_het_sharders())
    message = str(raised.value)
    assert message.startswith("$TORCHREC_HET_PROFILE='/p/profile.pt': the access profile ") and mismatch in message
    assert "\n" not in message and isinstance(raised.value, ValueError)


# --- counters as plain numbers --------------------------------------------------------------------


def test_cache_counters_are_plain_python_numbers() -> None:
    stats = GroupStats(num_tables=2, dim=3)
    stats.add("lookups", torch.tensor([0, 0, 1]))
    stats.add_mass("grad_produced", torch.tensor([1]), torch.ones(1, 3))
    table = stats.table(1)
    assert table["lookups"] == 1 and table["grad_produced"] == [1.0, 1.0, 1.0]
    assert all(isinstance(v, (int, float, list)) for v in table.values()), table
    assert all(isinstance(x, (int, float)) for v in table.values() if isinstance(v, list) for x in v), table
