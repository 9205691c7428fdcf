"""Memory: samples, per-module bytes, leaks, OOM forensics and the OOM retry, and the memory instruments."""
