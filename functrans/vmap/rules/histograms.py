"""histograms batching rules (being written)."""
