"""Train pipelines: Persia's hybrid synchronization (:class:`HybridTrainPipeline`) and TorchRec's
semi-sync pipeline made to run on CPU (:func:`semi_sync_pipeline_class`)."""

from torchrec_het.pipeline.hybrid import HybridTrainPipeline, StalenessGauge


def semi_sync_pipeline_class() -> type:
    """TorchRec's ``TrainPipelineSemiSync``, with the CPU adapter of ``torchrec_het._compat.cpu_semi_sync_class``."""
    from torchrec_het import _compat

    return _compat.cpu_semi_sync_class()


__all__ = ["HybridTrainPipeline", "StalenessGauge", "semi_sync_pipeline_class"]
