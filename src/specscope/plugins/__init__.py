"""Code that runs inside serving engines' processes: per-step phase timing (`steps.py`, engine-neutral) and the
adapters that feed it (`vllm.py`, a vLLM general plugin)."""
