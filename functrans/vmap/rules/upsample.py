"""upsample batching rules (being written)."""
