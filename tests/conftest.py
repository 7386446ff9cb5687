import os
import sys

import pytest
import torch

# one thread: several test processes often share the 2 cores, and OpenMP oversubscription is very slow
torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    """Every test gets its own registry DB; the model cache stays shared (pulling SmolLM2 costs ~30 s)."""
    monkeypatch.setenv("SPECSCOPE_DB", str(tmp_path / "runs.db"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    # no test reaches the Hugging Face Hub: a hub id resolves only from a cache the test writes itself
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub-cache"))
    # the suite's timings decide nothing, and it must pass on a loaded machine: no measurement is refused as
    # "loaded" here (tests/test_loaded_prices.py sets the real rule back and plants the load itself)
    monkeypatch.setenv("SPECSCOPE_LOADED_CORES", "inf")
