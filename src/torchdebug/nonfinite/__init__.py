"""NaN/Inf: the op-level tracer, replay of a failing step, hints, locate_nonfinite."""
