"""The figures tests state for the planner when they check plumbing, not the planner's choice: a
slow link and fixed compute, so the plugin's plan beats TorchRec's by more than the model's error at
the smoke sizes whatever the machine running the tests measures (a loaded 2-core CI machine's
compute probe can spread 20x)."""

SLOW_LINK_GBIT = "0.05,0.05"  # TORCHREC_HET_LINK_GBIT: within and between hosts
STEP_COMPUTE = "200,30"  # TORCHREC_HET_STEP_COMPUTE: ns per id looked up, us per sample of the dense part

SLOW_LINK_PLAN = {"TORCHREC_HET_LINK_GBIT": SLOW_LINK_GBIT, "TORCHREC_HET_STEP_COMPUTE": STEP_COMPUTE}
