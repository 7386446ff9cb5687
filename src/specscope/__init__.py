"""specscope: fast, lossless and explainable speculative decoding."""

import os

# torch's own ops in a decode step (the embedding, sampling's reductions, the stock paths) run on torch's libgomp
# threads, which by default spin ~0.3 ms after every region: on a machine that is not ours alone they take a core
# from the row kernels' pool (models/csrc/pool.h, which spins briefly, then yields and sleeps) and from everyone
# else, for regions that are a sliver of a step. Passive waiting costs a wake-up per torch region instead. Read by
# libgomp when torch loads, so it applies where specscope is imported first (the CLI always is); a value the user
# set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
