"""Rank bodies and harness of the tests that need the benchmark's tooling: byte accounting
(``comm_ranks``, ``het_step_ranks``, ``two_hosts_ranks``), emulated hosts (``netem_ranks``,
``emulated_launch``), the DLRM recipe (``killed_recipe``) and plan-independent table
initialization (``table_init_ranks``).

They live beside the benchmark because they import it; ``torchrec_het_testing`` (the rank
bodies of the runtime's tests) does not import the benchmark.
"""
