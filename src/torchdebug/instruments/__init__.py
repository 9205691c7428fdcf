"""Instruments that watch() installs: one per file (health, memory, timing, flops, profiler).

Each follows the protocol in docs/architecture.md; watch() builds them from ``DebugConfig.instruments()``.
"""
