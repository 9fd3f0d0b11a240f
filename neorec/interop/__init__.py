"""Bridges to other recommendation libraries (optional dependencies, imported on first use)."""
