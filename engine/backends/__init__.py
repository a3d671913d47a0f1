"""Backends other than the built-in engine (engine/backend.py)."""
