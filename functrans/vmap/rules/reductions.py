"""(being written) Batching rules for the reductions family."""
