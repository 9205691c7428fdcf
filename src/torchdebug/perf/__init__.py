"""Performance: step timing, FLOPs, per-module time, the torch.profiler wrapper and instrument, the speed-mode A/B harness."""
