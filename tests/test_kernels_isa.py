"""Every instruction set's row kernels (AVX-512 with and without AVX512_BF16, AVX2+FMA, NEON), checked where this host can run them: natively,
or NEON under qemu-user with a cross compiler (Debian's g++-aarch64-linux-gnu and qemu-user; `make kernel-tools`
installs them). tests/csrc/kernel_check.cpp compares every kernel with a float64 reference and checks that 1 row
and n rows give the same bits; a path this host cannot run is still compiled, and the skip says why."""

import shutil
import subprocess

import pytest

from specscope.models import rowgemm

CHECK = rowgemm.CSRC.parents[3] / "tests" / "csrc" / "kernel_check.cpp"
if not CHECK.exists():   # running from an installed package: the check lives in the repository
    CHECK = __import__("pathlib").Path(__file__).parent / "csrc" / "kernel_check.cpp"
CROSS = "aarch64-linux-gnu-g++"


def _host_runs(isa: str) -> bool:
    machine = rowgemm._machine()
    if isa == "neon":
        return machine == "aarch64"
    return machine == "x86_64" and rowgemm.ISAS[isa][0] <= rowgemm.cpu_flags()


def _compile(cxx: str, isa: str, out, extra=()):
    flags = [f for f in rowgemm.build_flags(isa) if f not in ("-shared", "-fPIC")]
    r = subprocess.run([cxx, *flags, *extra, f"-I{rowgemm.CSRC}", "-o", str(out), str(CHECK)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{isa} kernels do not compile:\n{r.stderr[-3000:]}"


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512", "avx2", "neon"])
def test_kernels_are_exact_and_row_invariant(isa, tmp_path):
    exe = tmp_path / f"kernel_check_{isa}"
    if _host_runs(isa):
        cxx = rowgemm._compiler()
        if cxx is None:
            pytest.skip("no C++ compiler on this host")
        _compile(cxx, isa, exe)
        assert _run([str(exe)]).split()[1] == isa
        return
    if isa == "neon":
        qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
        if not (shutil.which(CROSS) and qemu):
            pytest.skip(f"this {rowgemm._machine()} host cannot run NEON code and has no {CROSS} + qemu-aarch64 to "
                        "emulate it (`make kernel-tools` installs them)")
        _compile(CROSS, isa, exe, ["-static"])
        assert _run([qemu, str(exe)]).split()[1] == "neon"
        return
    cxx = rowgemm._compiler()
    if cxx is None or rowgemm._machine() != "x86_64":
        pytest.skip(f"this {rowgemm._machine()} host cannot build or run {isa} code")
    _compile(cxx, isa, exe)   # it builds, at least
    pytest.skip(f"compiled only: this CPU lacks {sorted(rowgemm.ISAS[isa][0] - rowgemm.cpu_flags())} to run {isa} "
                "code, and qemu-user does not emulate it")
