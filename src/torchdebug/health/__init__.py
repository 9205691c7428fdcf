"""Gradient and training health: pure gradient maths, model inspection, the health instrument and its rules."""
