"""`specscope bench-serve`: load an OpenAI-compatible endpoint (specscope, vLLM, SGLang) with a streaming client
and measure TTFT, inter-token latency, end-to-end latency and output tok/s per concurrency level, plus acceptance
from the server's /metrics deltas."""
