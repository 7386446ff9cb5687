"""`specscope serve` (or any specscope command that prints `listening on URL`) in a subprocess for tests, and the
base of the in-thread fake HTTP servers the tests stand up on loopback."""

import http.server
import subprocess
import sys
import tempfile
import threading


class Background:
    """Starts `python -m specscope ARGV...` and waits until it prints where it listens (self.url)."""

    def __init__(self, argv: list[str], env: dict, cwd=None, start_timeout: float = 300, preexec_fn=None):
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody drains (which could block it)
        self.proc = subprocess.Popen([sys.executable, "-m", "specscope", *argv], env=env, cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=self.err, preexec_fn=preexec_fn)
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


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A fake server's handler: no request log on stderr, `_send` for one whole response."""

    def log_message(self, *a):
        pass

    def _send(self, status, body: bytes, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LoopbackThread:
    """`handler` served on 127.0.0.1 (a free port) by a daemon thread: self.url, self.port, close()."""

    def __init__(self, handler, server_cls=http.server.ThreadingHTTPServer):
        self.httpd = server_cls(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
