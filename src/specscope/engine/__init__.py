"""Batched decoding: many sequences in one target forward (engine/batch.py)."""

from specscope.engine.batch import BatchEngine, Finished, Request

__all__ = ["BatchEngine", "Finished", "Request"]
