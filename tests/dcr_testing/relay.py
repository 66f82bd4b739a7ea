"""Real relay processes on 127.0.0.1 for the relay tests: started with ``python -m nemo_dcr relay``,
ready when they print their URL, killed with SIGKILL or stopped with SIGTERM."""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

READY = re.compile(r"nemo-dcr relay: serving .* at (http://\S+)")


class RelayProc:
    def __init__(self, upstreams, *args, env=None, listen="127.0.0.1:0", timeout=60.0):
        ups = [upstreams] if isinstance(upstreams, str) else list(upstreams)
        cmd = [sys.executable, "-m", "nemo_dcr", "relay", "--listen", listen]
        for u in ups:
            cmd += ["--upstream", u]
        cmd += [str(a) for a in args]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.out, self.err = [], []
        self._lines: queue.Queue = queue.Queue()
        for stream, keep in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, keep), daemon=True).start()
        m = self.wait_line(READY, timeout)
        self.url = m.group(1)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def _pump(self, stream, keep):
        for line in stream:
            keep.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_line(self, pattern, timeout=60.0):
        """The first output line (stdout or stderr) matching ``pattern``, waiting for it."""
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.01, left))
            except queue.Empty:
                line = ""
            if line is None or left <= 0:
                raise AssertionError(f"relay never printed {pattern.pattern!r}; "
                                     f"rc={self.proc.poll()} output: {''.join(self.out + self.err)[-3000:]}")
            m = pattern.search(line)
            if m:
                return m

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return "".join(self.out + self.err)


def raw_get(port, path, headers=(), method="GET"):
    """-> (status, body) for ``METHOD path`` sent byte for byte over a plain socket (no client
    library normalises the path or the headers first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        req = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + \
              "".join(f"{h}\r\n" for h in headers) + "\r\n"
        s.sendall(req.encode("latin-1"))
        data = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            data += b
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def wait_until(cond, what, timeout=30.0, step=0.01):
    """Wait for a condition another process brings about (not a sleep standing in for one)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def model(seed=0, n=64 * 1024):
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": torch.randn(n // 64, 64, generator=g).bfloat16(),
        "layers.0.bias": torch.randn(64, generator=g),
        "emb": torch.randn(50, 16, generator=g).half(),
    }


def train_step(state, seed):
    """Bump the raw bits of ~3 % of every tensor's elements (a sparse optimizer-like update)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for t in state.values():
        ints = t.view(torch.int16 if t.element_size() == 2 else torch.int32).view(-1)
        ints[torch.rand(ints.shape, generator=g) < 0.03] += 1
