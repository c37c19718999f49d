"""spatial batching rules (being written)."""
