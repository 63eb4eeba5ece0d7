"""Offline acceptance of drafters on held-out rows, and reloading runs for it."""
