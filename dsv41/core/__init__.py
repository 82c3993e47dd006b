"""Numerics, errors, text, the config and output folders; nothing here imports torch when it loads."""
