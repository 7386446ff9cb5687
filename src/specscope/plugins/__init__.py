"""Code that runs inside serving engines' processes: per-step phase timing (`steps.py`, engine-neutral), the
adapters that feed it (`vllm.py`, a vLLM general plugin) and its capture mode (`capture.py`: the target's hidden
states for drafter training, written by vLLM's workers)."""
