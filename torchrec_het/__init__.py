"""torchrec_het: skew-aware embedding sharding for TorchRec.

Importing this package changes nothing in TorchRec; ``torchrec_het.install()`` registers
the plugin's sharders and planner components (``torchrec_het.registration``) and
``torchrec_het.uninstall()`` takes them out again.
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


__all__ = ["__version__", "install", "uninstall"]
