"""specscope: fast, lossless and explainable speculative decoding."""

# No process-wide OpenMP default here: torch's own ops in a decode step run on the calling thread
# (models/rowgemm.py step_threads), so torch's libgomp threads never spin beside the kernels' pool, and an
# OMP_WAIT_POLICY set on import would leak into every engine specscope starts (a swept vLLM, a capture's vLLM).

__version__ = "0.1.0"
