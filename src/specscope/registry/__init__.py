"""Run registry: records of every run (config, environment fingerprint, results, per-cycle samples) in SQLite."""

from specscope.registry.db import Registry, check_registry, default_db_path, open_registry
from specscope.registry.records import (drafting_config, machine_config, make_record, model_hash, per_prompt_stats,
                                        prompt_set_hash, store_record)

__all__ = ["Registry", "open_registry", "check_registry", "default_db_path", "make_record", "store_record",
           "model_hash", "prompt_set_hash", "per_prompt_stats", "machine_config", "drafting_config"]
