"""`specscope serve`: an OpenAI-compatible HTTP server over the baseline / speculative engine.

protocol.py parses and validates request bodies, worker.py runs one engine thread over a bounded queue,
metrics.py holds the Prometheus counters (vLLM-named spec counters + per-phase histograms), app.py wires FastAPI.
"""
