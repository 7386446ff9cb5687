"""The decoding loop: requests (engine/request.py) decoded together, plain and speculative (engine/batch.py)."""

from specscope.engine.batch import BatchEngine, StepRecord
from specscope.engine.request import Finished, Request

__all__ = ["BatchEngine", "Finished", "Request", "StepRecord"]
