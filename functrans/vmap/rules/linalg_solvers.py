"""linalg_solvers batching rules (being written)."""
