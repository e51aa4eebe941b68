"""Backends compute the model: `reference` (numpy, the executable specification) and, later, `cuda`."""
