"""embedding batching rules (being written)."""
