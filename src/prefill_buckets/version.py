"""The package's version (setup.py reads it here)."""

__version__ = "0.1.0"
