"""Settings shared by the fault tests: the launcher environment that plans each case."""

from pathlib import Path

import pytest

from torchrec_het.planner.compute_costs import save_bytes_only_table
from torchrec_het_testing.bench_runs import smoke_profile
from torchrec_het_testing.stated_plan_figures import SLOW_LINK_PLAN

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def case_settings(tmp_path_factory) -> dict[str, dict[str, str]]:
    """``TORCHREC_HET_*`` settings per case: the plugin's lookups priced on par with row_wise, a slow
        link and fixed compute stated (so the plugin's plan beats TorchRec's by more than the model's error at the smoke
        sizes, whatever the emulated link measures) and the evidence for the case's type: a stated
        skew plans ``het_cached_row_wise``, a profile ``het_row_replicated``, and ``hybrid`` is the
        first with the recipe's ``TrainPipelineSparseDist`` made the hybrid pipeline (k = 1); ``lookahead``
    is the second looking one batch ahead."""
    folder = tmp_path_factory.mktemp("settings")
    costs = str(save_bytes_only_table(folder / "on_par.json", "tests: lookups on par with row_wise"))
    profile = smoke_profile(folder / "smoke.pt")
    common = {"TORCHREC_HET_COMPUTE_COSTS": costs, **SLOW_LINK_PLAN}
    return {
        "het_cached_row_wise": {**common, "TORCHREC_HET_ALPHA": "1.05"},
        "het_row_replicated": {**common, "TORCHREC_HET_PROFILE": profile},
        "hybrid": {**common, "TORCHREC_HET_ALPHA": "1.05", "TORCHREC_HET_EMBEDDING_STALENESS": "1"},
        "lookahead": {**common, "TORCHREC_HET_PROFILE": profile, "TORCHREC_HET_LOOKAHEAD": "1"},
    }


@pytest.fixture(scope="session")
def planned_types() -> dict[str, str]:
    """The sharding type each case's settings plan for ``t_cat_0``."""
    return {
        "het_cached_row_wise": "het_cached_row_wise",
        "het_row_replicated": "het_row_replicated",
        "hybrid": "het_cached_row_wise",
        "lookahead": "het_row_replicated",
    }
