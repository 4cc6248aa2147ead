"""Trace replay: placement policies replayed over a real GPU cluster trace, and the benchmark report."""
