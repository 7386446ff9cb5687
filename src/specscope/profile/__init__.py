"""Cycle profiler: where each speculative (or baseline) cycle's time goes."""

from specscope.profile.cycle import PHASE_LABELS, CycleProfiler

__all__ = ["CycleProfiler", "PHASE_LABELS"]
