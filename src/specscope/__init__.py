"""specscope: fast, lossless and explainable speculative decoding."""

import os

# torch's own ops in a decode step (the embedding, sampling's reductions, the stock paths) run on torch's libgomp
# threads, which by default spin ~0.3 ms after every region: on a machine that is not ours alone they take a core
# from the row kernels' pool (models/csrc/pool.h, which spins briefly, then yields and sleeps) and from everyone
# else, for regions that are a sliver of a step. Passive waiting costs a wake-up per torch region instead. Read by
# libgomp when torch loads, so it applies where specscope is imported first (the CLI always is); a value the user
# set wins.
_OURS: dict[str, str] = {}     # defaults specscope set for itself: the engines it starts must not inherit them
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = _OURS["OMP_WAIT_POLICY"] = "PASSIVE"


def user_environ() -> dict[str, str]:
    """The environment as the user set it up: os.environ less the defaults specscope set for itself. A vLLM that a
    sweep or a capture starts runs its own OpenMP kernels, and a passive wait it never asked for changed its verify
    time by 30 % (tests/engines/test_sweep.py)."""
    env = dict(os.environ)
    for k, v in _OURS.items():
        if env.get(k) == v:
            del env[k]
    return env


__version__ = "0.1.0"
