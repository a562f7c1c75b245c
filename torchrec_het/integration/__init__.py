"""How the plugin joins TorchRec and a job: ``install()`` (:mod:`.registration`), the ``TORCHREC_HET_*``
settings (:mod:`.env_settings`), the CPU budget, clear collective errors, the plan's run-time check and
the per-table counters."""
