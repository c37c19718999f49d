"""(being written) Batching rules for the linalg family."""
