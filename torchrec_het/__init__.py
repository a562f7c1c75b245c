"""torchrec_het: skew-aware embedding sharding for TorchRec.

Importing this package changes nothing in TorchRec; ``torchrec_het.install()`` registers
the plugin's sharders and planner components (``torchrec_het.integration.registration``) and
``torchrec_het.uninstall()`` takes them out again; ``torchrec_het.stats_by_table(model)``
gives the plugin's counters (cache hits, replica syncs) of every plugin-sharded table, and
``torchrec_het.describe_stats(stats)`` puts them in labelled lines;
``torchrec_het.watch_plan(model, plan)`` checks the measured step time against the plan's prediction
(``install()`` does it for every ``DistributedModelParallel``).
"""

__version__ = "0.1.0"


def install(*args, **kwargs) -> None:
    """See :func:`torchrec_het.integration.registration.install`."""
    from torchrec_het.integration.registration import install as _install

    _install(*args, **kwargs)


def uninstall() -> None:
    """See :func:`torchrec_het.integration.registration.uninstall`."""
    from torchrec_het.integration.registration import uninstall as _uninstall

    _uninstall()


def stats_by_table(model) -> dict[str, dict]:
    """See :func:`torchrec_het.integration.stats.stats_by_table`: the plugin's counters per table, on this rank."""
    from torchrec_het.integration.stats import stats_by_table as _stats_by_table

    return _stats_by_table(model)


def describe_stats(stats: dict[str, dict]) -> list[str]:
    """See :func:`torchrec_het.integration.stats.describe_stats`: one labelled line per table of ``stats_by_table``."""
    from torchrec_het.integration.stats import describe_stats as _describe_stats

    return _describe_stats(stats)


def watch_plan(model, plan_or_prediction, warmup: int = 20, window: int = 50):
    """See :func:`torchrec_het.integration.plan_check.watch_plan`: after ``warmup`` steps, ``model``'s median step over
    ``window`` steps against the plan's prediction; rank 0 logs one line when they differ by more than 25%."""
    from torchrec_het.integration.plan_check import watch_plan as _watch_plan

    return _watch_plan(model, plan_or_prediction, warmup=warmup, window=window)


__all__ = ["__version__", "describe_stats", "install", "stats_by_table", "uninstall", "watch_plan"]
