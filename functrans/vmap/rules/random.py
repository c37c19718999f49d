"""(being written) Batching rules for the random family."""
