"""(being written) Batching rules for the views family."""
