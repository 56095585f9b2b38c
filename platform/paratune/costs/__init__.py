"""Predict before you spend: memory, compute, communication, step time, clusters; the plan's numbers."""
