"""The package version (single source, read by hatchling)."""

__version__ = "0.2.0"
