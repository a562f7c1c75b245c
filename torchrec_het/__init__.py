"""torchrec_het: skew-aware embedding sharding for TorchRec.

Importing this package changes nothing in TorchRec; ``torchrec_het.install()`` registers
the plugin's sharders and planner components (``torchrec_het.registration``) and
``torchrec_het.uninstall()`` takes them out again; ``torchrec_het.stats_by_table(model)``
gives the plugin's counters (cache hits, replica syncs) of every plugin-sharded table.
"""

__version__ = "0.1.0"


def install(*args, **kwargs) -> None:
    """See :func:`torchrec_het.registration.install`."""
    from torchrec_het.registration import install as _install

    _install(*args, **kwargs)


def uninstall() -> None:
    """See :func:`torchrec_het.registration.uninstall`."""
    from torchrec_het.registration import uninstall as _uninstall

    _uninstall()


def stats_by_table(model) -> dict[str, dict]:
    """See :func:`torchrec_het.stats.stats_by_table`: the plugin's counters per table, on this rank."""
    from torchrec_het.stats import stats_by_table as _stats_by_table

    return _stats_by_table(model)


__all__ = ["__version__", "install", "stats_by_table", "uninstall"]
