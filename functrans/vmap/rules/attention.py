"""attention batching rules (being written)."""
