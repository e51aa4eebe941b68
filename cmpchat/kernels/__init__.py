"""One module per kernel family, each with its launcher (shape and dtype checks)."""
