"""What both plugin sharding types share: the per-batch context, exchanges, id space, output layout, batch checks."""
