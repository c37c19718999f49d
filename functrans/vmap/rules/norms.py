"""norms batching rules (being written)."""
