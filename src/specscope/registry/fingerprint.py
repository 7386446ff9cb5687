"""Environment fingerprint: everything about the machine and software that can change a run's speed.

`collect()` returns a JSON-able dict with a fixed set of keys. A field that cannot be read is None, and the section
says why in its "reason" (e.g. no NVIDIA driver on a CPU machine), so "unknown" is never confused with "absent".
Nothing here imports torch unless it is already imported (or `torch_details=True`): fingerprinting stays cheap
for tools that do not use it.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from specscope import __version__, cpuload

ENV_PREFIXES = ("NCCL_", "CUDA_", "OMP_", "MKL_", "TORCH_", "PYTORCH_", "SPECSCOPE_KERNELS")
PACKAGES = ("torch", "transformers", "specscope", "numpy", "safetensors", "tokenizers", "triton")

GPU_FIELDS = ("name", "uuid", "memory_total_mib", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz",
              "mem_clock_max_mhz", "app_sm_clock_mhz", "power_limit_w", "power_draw_w", "temperature_c",
              "throttle_reasons", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "persistence_mode",
              "mig_mode")
# Fields that move between two otherwise identical runs; `compare` leaves them out of the differences
# ("gpu.devices" repeats every GPU's volatile fields; GPU 0 is compared field by field).
VOLATILE = ("collected_at", "memory.available_mib", "gpu.power_draw_w", "gpu.temperature_c", "cpu.freq_mhz",
            "torch.threads_chosen",
            "gpu.devices")


def collect(torch_details: bool = False) -> dict:
    return {
        "schema": 1,
        "collected_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": _cpu(),
        "memory": _memory(),
        "os": _os(),
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "packages": _packages(),
        "torch": _torch(torch_details),
        "git": _git(),
        "vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "gpu": _gpu(),
    }


def _cpu() -> dict:
    out = {"model": None, "arch": platform.machine(), "cores_physical": None, "cores_logical": os.cpu_count(),
           "cores_usable": None, "freq_mhz": None, "freq_max_mhz": None}
    flags: set[str] = set()
    try:   # the first processor's model name and flags (x86 "flags", aarch64 "Features")
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and out["model"] is None:
                out["model"] = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if out["model"] is None:
        out["model"] = platform.processor() or None
    try:
        out["cores_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        out["cores_usable"] = os.cpu_count()
    try:
        import psutil

        out["cores_physical"] = psutil.cpu_count(logical=False)
        f = psutil.cpu_freq()
        if f:
            out["freq_mhz"], out["freq_max_mhz"] = round(f.current), (round(f.max) or None)
    except Exception:       # psutil cannot read frequencies inside some containers
        pass
    try:
        # runnable processes, rounded: on a shared machine competing load is a first-order cause of slowdowns,
        # and rounding keeps jitter out of the differences `compare` lists
        out["load_1m"] = round(os.getloadavg()[0])
    except OSError:
        out["load_1m"] = None
    quota = _cgroup_cpu_quota()
    if quota:
        out["cgroup_cpu_quota"] = quota
    out.update(_simd(flags))
    return out


def _simd(flags: set[str]) -> dict:
    """The vector extensions the CPU exposes (a hypervisor may hide AVX-512) and the row kernels' instruction set
    in this process (None: the stock oneDNN path, or no model loaded), which decide CPU decode speed more than the
    model name does. Without importing torch (the registry stays light)."""
    simd = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "fma", "asimd", "sve", "bf16") if f in flags]
    rg = sys.modules.get("specscope.models.rowgemm")   # loaded with a model; its library decides the kernels
    kernels = rg._isa if rg is not None and rg._lib_state == "loaded" else None
    return {"simd": ",".join(simd) or None, "row_kernels": kernels}


def _cgroup_cpu_quota():
    try:
        q, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if q == "max" else round(int(q) / int(period), 2)
    except (OSError, ValueError):
        return None


def _memory() -> dict:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return {"total_mib": vm.total >> 20, "available_mib": vm.available >> 20}
    except Exception as e:
        return {"total_mib": None, "available_mib": None, "reason": f"psutil: {e}"}


def _os() -> dict:
    distro = None
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                distro = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {"system": platform.system(), "kernel": platform.release(), "distro": distro,
            "libc": " ".join(platform.libc_ver()).strip() or None}


def _packages() -> dict:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    if out["specscope"] is None:
        out["specscope"] = __version__
    return out


def _torch(details: bool) -> dict:
    out = {"cuda_runtime": None, "cudnn": None, "nccl": None, "threads": None, "interop_threads": None,
           "mkldnn": None}
    if "torch" not in sys.modules and not details:
        out["reason"] = "torch not imported by this process"
        return out
    try:
        import torch
    except ImportError:
        out["reason"] = "torch is not installed"
        return out
    out["cuda_runtime"] = torch.version.cuda
    out["threads"] = torch.get_num_threads()
    choice = cpuload.thread_choice()    # a decode command's default follows the cores free at its start
    if choice is not None:
        out["threads_chosen"] = choice.words()
    out["interop_threads"] = torch.get_num_interop_threads()
    out["mkldnn"] = bool(torch.backends.mkldnn.is_available())
    if torch.version.cuda is None:
        out["reason"] = "CPU build of torch: no CUDA, cuDNN or NCCL"
        return out
    try:
        out["cudnn"] = torch.backends.cudnn.version()
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        out["reason"] = f"cuDNN/NCCL version unavailable: {e}"
    return out


def _git() -> dict:
    """Commit of the specscope checkout this code runs from (not the caller's cwd)."""
    root = None
    for parent in Path(__file__).resolve().parents:
        if (parent / ".git").exists():
            root = parent
            break
    if root is None:
        return {"commit": None, "dirty": None, "branch": None, "reason": "specscope is not run from a git checkout"}

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        # tracked changes only: untracked scratch files do not change what runs
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        branch = git("rev-parse", "--abbrev-ref", "HEAD")
        return {"commit": commit, "dirty": dirty, "branch": branch}
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": None, "dirty": None, "branch": None, "reason": f"git failed: {e}"}


def _gpu() -> dict:
    """NVML view of GPU 0 (the one specscope uses) plus all devices; None fields and a reason without NVML."""
    out = {"count": 0, "driver_version": None, "cuda_driver_version": None, "nvml_version": None,
           **{f: None for f in GPU_FIELDS}, "devices": []}
    try:
        import pynvml as nv
    except ImportError:
        out["reason"] = "nvidia-ml-py is not installed"
        return out
    try:
        nv.nvmlInit()
    except Exception as e:
        out["reason"] = f"NVML unavailable ({e}): no NVIDIA driver on this machine"
        return out
    try:
        out["driver_version"] = _call(nv.nvmlSystemGetDriverVersion)
        cv = _call(nv.nvmlSystemGetCudaDriverVersion_v2)
        out["cuda_driver_version"] = f"{cv // 1000}.{cv % 1000 // 10}" if isinstance(cv, int) else None
        out["nvml_version"] = _call(nv.nvmlSystemGetNVMLVersion)
        out["count"] = nv.nvmlDeviceGetCount()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        for i in range(out["count"]):
            out["devices"].append(_device(nv, i))
        if out["devices"]:
            first = out["devices"][0]
            if visible and visible.split(",")[0].strip().isdigit():
                idx = int(visible.split(",")[0])
                first = out["devices"][idx] if idx < len(out["devices"]) else first
            out.update({f: first.get(f) for f in GPU_FIELDS})
        else:
            out["reason"] = "NVML sees no GPU"
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
    return out


def _call(fn, *args):
    try:
        v = fn(*args)
        return v.decode() if isinstance(v, bytes) else v
    except Exception:       # NVMLError_NotSupported and friends: that field stays None
        return None


def _device(nv, i: int) -> dict:
    h = nv.nvmlDeviceGetHandleByIndex(i)
    d = {"index": i, "name": _call(nv.nvmlDeviceGetName, h), "uuid": _call(nv.nvmlDeviceGetUUID, h)}
    mem = _call(nv.nvmlDeviceGetMemoryInfo, h)
    d["memory_total_mib"] = (mem.total >> 20) if mem is not None else None
    d["sm_clock_mhz"] = _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
    d["sm_clock_max_mhz"] = _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
    d["mem_clock_mhz"] = _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
    d["mem_clock_max_mhz"] = _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM)
    d["app_sm_clock_mhz"] = _call(nv.nvmlDeviceGetApplicationsClock, h, nv.NVML_CLOCK_SM)
    pl = _call(nv.nvmlDeviceGetEnforcedPowerLimit, h) or _call(nv.nvmlDeviceGetPowerManagementLimit, h)
    d["power_limit_w"] = round(pl / 1000, 1) if pl else None
    pw = _call(nv.nvmlDeviceGetPowerUsage, h)
    d["power_draw_w"] = round(pw / 1000, 1) if pw else None
    d["temperature_c"] = _call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
    reasons = _call(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                    or nv.nvmlDeviceGetCurrentClocksThrottleReasons, h)
    d["throttle_reasons"] = _reason_names(nv, reasons) if reasons is not None else None
    d["pcie_gen"] = _call(nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
    d["pcie_gen_max"] = _call(nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
    d["pcie_width"] = _call(nv.nvmlDeviceGetCurrPcieLinkWidth, h)
    d["pcie_width_max"] = _call(nv.nvmlDeviceGetMaxPcieLinkWidth, h)
    d["persistence_mode"] = _call(nv.nvmlDeviceGetPersistenceMode, h)
    mig = _call(nv.nvmlDeviceGetMigMode, h)
    d["mig_mode"] = mig[0] if isinstance(mig, (list, tuple)) else mig
    return d


def _reason_names(nv, mask: int) -> list[str]:
    names = []
    for attr in dir(nv):
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            if attr.startswith(prefix) and attr[len(prefix):] not in ("All", "None"):
                bit = getattr(nv, attr)
                label = attr[len(prefix):]
                if isinstance(bit, int) and bit and mask & bit and label not in names:
                    names.append(label)
    return sorted(names)


def flatten(d: dict, prefix: str = "") -> dict:
    """{"gpu": {"name": x}} -> {"gpu.name": x}; lists stay values (throttle reasons compare as a whole)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _overloaded(env: dict | None) -> tuple | None:
    """(load, cores) when the 1-minute load average was above the usable cores, else None."""
    env = env or {}
    if env.get("ingested"):
        return None             # the engine ran elsewhere; the local load says nothing about it
    cpu = env.get("cpu") or {}
    load, cores = cpu.get("load_1m"), cpu.get("cores_usable") or cpu.get("cores_logical")
    if not isinstance(load, (int, float)) or not isinstance(cores, int) or cores < 1 or load <= cores:
        return None
    return load, cores


def _load_words(load, cores) -> str:
    return f"a 1-minute load average of {load} on {cores} usable core{'s' if cores > 1 else ''}"


def load_warning(env: dict | None) -> str | None:
    """A run timed while the machine was oversubscribed (1-minute load average above the usable cores): its
    timings measure the contention as much as the code, so it is not comparable with a quiet run."""
    over = _overloaded(env)
    if over is None:
        return None
    return (f"recorded with {_load_words(*over)}: other work competed for the CPUs, so its timings are not "
            f"comparable with a quiet run")


def load_now() -> dict:
    """The part of the fingerprint `load_warning` reads, measured now: the 1-minute load average (rounded, as
    collect() stores it) and the usable cores. Cheap: no packages, no GPU query."""
    try:
        load = round(os.getloadavg()[0])
    except OSError:
        load = None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    return {"cpu": {"load_1m": load, "cores_usable": cores}}


def timing_warning(*envs: dict | None) -> str | None:
    """One line for a command that times something (verify-curve, bench-serve, tune --validate, generate, the
    benches): the first of these environments (a stored record's, then load_now() at the end of the timing) that
    was oversubscribed, or None. Measured at the end: the 1-minute average then covers the last minute of work."""
    for env in (*envs, load_now()):
        over = _overloaded(env)
        if over:
            return (f"warning: timed with {_load_words(*over)}: other work competed for the CPUs, so these timings "
                    f"are not comparable with a quiet run; measure again on a quieter machine before trusting them")
    return None
