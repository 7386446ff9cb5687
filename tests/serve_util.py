"""`specscope serve` (or any specscope command that prints `listening on URL`) in a subprocess for tests."""

import subprocess
import sys
import tempfile
import threading


class Background:
    """Starts `python -m specscope ARGV...` and waits until it prints where it listens (self.url)."""

    def __init__(self, argv: list[str], env: dict, cwd=None, start_timeout: float = 300):
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody drains (which could block it)
        self.proc = subprocess.Popen([sys.executable, "-m", "specscope", *argv], env=env, cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=self.err)
        self.url = None
        got = threading.Event()

        def read():
            for line in self.proc.stdout:
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(start_timeout):
            self.stop()
            self.err.seek(0)
            raise RuntimeError(f"`specscope {' '.join(argv)}` did not start: {self.err.read()[-2000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
