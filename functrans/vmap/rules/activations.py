"""activations batching rules (being written)."""
