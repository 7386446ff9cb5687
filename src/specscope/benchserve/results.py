"""bench-serve's result files: each concurrency level as `vllm bench serve --save-result` writes it (its layout,
field names, units and file names), or one JSON line per level with --append-result."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from specscope.benchserve.run import DETAILED, LISTS
from specscope.errors import SpecscopeError
from specscope.fileio import read_text, write_atomic


def vllm_result(lv: dict, lists: dict, config: dict, run_id, date: str, num_prompts: int, detailed: bool) -> dict:
    """One level as `vllm bench serve --save-result` writes it: its setup fields, its benchmark fields (same names,
    same units: seconds for duration and the per-request lists, ms for the statistics, acceptance rate in
    percent), then specscope's own (base_url, dataset, spec_decode block, run id)."""
    res = {"date": date, "endpoint_type": config["backend"], "backend": config["backend"], "label": config["label"],
           "model_id": config["model"], "tokenizer_id": config["tokenizer"], "num_prompts": num_prompts,
           **config["metadata"], "request_rate": config["request_rate"], "burstiness": config["burstiness"],
           "max_concurrency": lv["max_concurrency"]}
    skip = ("max_concurrency", "request_rate", "burstiness", "num_prompts", "server_metrics")
    for k, v in lv.items():
        if k == "max_output_tokens_per_s":      # vLLM's order: the per-request lists come before the peaks
            res.update({n: lists[n] for n in LISTS if detailed or n not in DETAILED})
        if k not in skip:
            res[k] = v
    res.update(base_url=config["url"], endpoint=config["endpoint_path"], dataset_name=config["prompt_set"],
               dataset_path=config["dataset_path"], ignore_eos=config["ignore_eos"], seed=config["seed"],
               temperature=config["sampling"]["temperature"], specscope_run_id=run_id)
    return res


def save_results(out: dict, config: dict, run_id, result_dir, result_filename, detailed: bool, *,
                 num_prompts: int, append: bool = False) -> list[str]:
    """One JSON per level in `vllm bench serve --save-result`'s layout and file names; with append (vLLM's
    --append-result) each level is one JSON line added to the file."""
    d = Path(result_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecscopeError(f"cannot use --result-dir {str(d)!r}: {e.strerror or e}") from None
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    prefix = config["label"] or config["backend"]
    model_base = str(out["model"]).rstrip("/").rsplit("/", 1)[-1]
    files = []
    for lv, lists in zip(out["levels"], out["lists"]):
        c = lv["max_concurrency"]
        result = vllm_result(lv, lists, config, run_id, date, num_prompts, detailed)
        if result_filename:
            name = result_filename if len(out["levels"]) == 1 or append else \
                result_filename.removesuffix(".json") + f"-concurrency{c}.json"
        else:
            name = (f"{prefix}-{config['request_rate']}qps" + (f"-concurrency{c}" if c else "")
                    + f"-{model_base}-{date}.json")
        target = d / name
        if append:
            old = read_text(target, "--append-result file") if target.is_file() else ""
            text = old + ("\n" if old.strip() and not old.endswith("\n") else "") \
                + json.dumps(result, default=str, allow_nan=False) + "\n"
        else:
            text = json.dumps(result, indent=2, default=str, allow_nan=False) + "\n"
        path = write_atomic(target, text, "--save-result file")
        if str(path) not in files:
            files.append(str(path))
    return files
