"""Speculation economics: the cost model, break-even analysis, the verify-cost curve and the tuner."""
