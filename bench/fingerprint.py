"""Device check: print this machine's environment fingerprint and check it is complete.

On a CPU machine the GPU fields must be None with a reason. On a GPU machine (NVML present) the NVML fields must be
filled, and the CUDA-event path of the cycle profiler is exercised against a synchronised wall clock.

    .venv/bin/python bench/fingerprint.py [--out FILE]      # exit 1 if something that should be known is missing
"""

from __future__ import annotations

import argparse
import json
import sys

NVML_REQUIRED = ("name", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz", "power_limit_w",
                 "temperature_c", "throttle_reasons", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max")


def check(fp: dict) -> list[str]:
    problems = []
    for key in ("model", "cores_logical", "cores_usable"):
        if not fp["cpu"].get(key):
            problems.append(f"cpu.{key} missing")
    for sect, key in (("memory", "total_mib"), ("os", "kernel"), ("python", "version"), ("packages", "torch"),
                      ("packages", "transformers"), ("packages", "specscope")):
        if not fp[sect].get(key):
            problems.append(f"{sect}.{key} missing")
    if fp["git"].get("commit") is None and not fp["git"].get("reason"):
        problems.append("git.commit missing without a reason")
    gpu = fp["gpu"]
    if gpu["count"]:
        for key in NVML_REQUIRED + ("driver_version", "cuda_driver_version"):
            if gpu.get(key) is None:
                problems.append(f"gpu.{key} missing on a GPU machine")
        if fp["torch"].get("cuda_runtime") and fp["torch"].get("nccl") is None:
            problems.append("torch.nccl missing with a CUDA build of torch")
    elif not gpu.get("reason") or any(gpu.get(k) is not None for k in NVML_REQUIRED):
        problems.append("GPU fields on a machine without NVML must be None with a reason")
    return problems


def cuda_profiler_check() -> dict:
    """CUDA events (no sync) vs synchronised perf_counter for the same matmul cycles: shares should agree."""
    import torch

    from specscope.profile import CycleProfiler

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = {}
    for sync in (False, True):
        prof = CycleProfiler("cuda", sync=sync)
        for _ in range(30):
            with prof.phase("draft"):
                a @ a
            with prof.phase("verify"):
                for _ in range(4):
                    a @ a
            prof.end_cycle(2, num_draft=1)
        s = prof.summary()
        out["events" if not sync else "synced"] = {
            "timer": s["timer"], "cycle_ms": s["cycle_ms"]["mean_ms"],
            "draft_ms": s["phases"]["draft"]["mean_ms"], "verify_ms": s["phases"]["verify"]["mean_ms"],
            "overhead_us_per_cycle": s["profiler_overhead"]["ms_per_cycle"] * 1e3,
            "overhead_share": s["profiler_overhead"]["share"]}
    ev, sy = out["events"], out["synced"]
    ratio = (ev["verify_ms"] / ev["draft_ms"]) if ev["draft_ms"] else None
    out["verify_over_draft_events"] = ratio
    out["ok"] = bool(ratio and 3.0 < ratio < 5.0 and abs(ev["verify_ms"] / sy["verify_ms"] - 1) < 0.25)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="print the environment fingerprint and check it")
    ap.add_argument("--out", default=None, help="Also write the JSON here.")
    args = ap.parse_args(argv)
    from specscope.registry.fingerprint import collect

    fp = collect(torch_details=True)
    report = {"fingerprint": fp, "problems": check(fp)}
    if fp["gpu"]["count"]:
        import torch

        if torch.cuda.is_available():
            report["cuda_profiler"] = cuda_profiler_check()
            if not report["cuda_profiler"]["ok"]:
                report["problems"].append("CUDA-event profiler disagrees with the synchronised clock")
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if report["problems"]:
        print("problems: " + "; ".join(report["problems"]), file=sys.stderr)
        return 1
    print("fingerprint complete" + (" (NVML fields filled)" if fp["gpu"]["count"] else
                                    " (no GPU: GPU fields None with a reason)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
