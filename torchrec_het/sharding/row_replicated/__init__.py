"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES)."""
