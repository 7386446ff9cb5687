"""`specscope serve`: an OpenAI-compatible HTTP server over our baseline / speculative decoding.

protocol.py parses and validates request bodies, worker.py runs one decoding thread over a bounded queue,
metrics.py holds the Prometheus counters (vLLM-named spec counters + per-phase histograms), app.py wires FastAPI.
"""
