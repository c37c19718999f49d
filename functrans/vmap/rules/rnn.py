"""rnn batching rules (being written)."""
