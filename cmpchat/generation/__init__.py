"""Turning logits into text: sampling, stop rules, output parsing and timed events."""
