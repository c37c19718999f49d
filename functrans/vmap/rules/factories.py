"""(being written) Batching rules for the factories family."""
