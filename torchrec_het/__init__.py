"""torchrec_het: skew-aware embedding sharding for TorchRec.

Importing this package changes nothing in TorchRec.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
