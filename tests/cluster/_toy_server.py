"""A tiny stand-in program for ServerProcess tests: not an engine, just a process that
serves /health (or fails to) the ways an engine server can. Usage:
    python _toy_server.py PORT MODE     MODE: serve | exit_early | never_healthy | grandchild
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def main() -> None:
    port, mode = int(sys.argv[1]), sys.argv[2]
    print(f"toy server pid={os.getpid()} mode={mode} "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')} "
          f"no_proxy={os.environ.get('no_proxy')}", flush=True)
    if mode == "exit_early":
        time.sleep(0.5)
        print("RuntimeError: weights file is corrupt (toy failure)", flush=True)
        sys.exit(3)
    if mode == "never_healthy":
        time.sleep(600)
    if mode == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"grandchild pid={child.pid}", flush=True)
    HTTPServer(("127.0.0.1", port), Health).serve_forever()


if __name__ == "__main__":
    main()
