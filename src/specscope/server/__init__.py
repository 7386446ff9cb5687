"""`specscope serve`: an OpenAI-compatible HTTP server over our baseline / speculative decoding.

protocol.py parses and validates request bodies, worker.py runs one thread that feeds a bounded queue of requests
into a continuous-batching engine (engine/batch.py), respond.py turns a request's jobs (one per choice) into its
answer or SSE stream, logprobs.py writes OpenAI's logprobs shapes, tokenize.py serves vLLM's /tokenize and
/detokenize, metrics.py holds the Prometheus counters (vLLM-named spec counters + engine step times), app.py wires
FastAPI.
"""
