"""The old, unpipelined ``het_row_replicated`` path: the per-host tier runs here until the pipelined path has it."""
