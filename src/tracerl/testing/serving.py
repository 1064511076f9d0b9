"""``tracerl serve`` as a subprocess for tests: a free loopback port, a client once the server
answers, and the server stopped with Ctrl-C (SIGINT) on the way out, whatever happened."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServedProcess:
    """A running ``tracerl serve``: its OpenAI client, and after the block its exit status
    and everything it printed."""

    client: Any
    process: subprocess.Popen[str]
    returncode: int | None = None
    output: str = field(default="")


@contextlib.contextmanager
def serve_subprocess(model: str | Path, store: str | Path, *, start_seconds: float = 120.0
                     ) -> Iterator[ServedProcess]:
    """Start ``tracerl serve --model MODEL --store STORE`` on a free port and wait until it
    lists its models (RuntimeError if it exits or does not answer within ``start_seconds``).
    On leaving the block the server gets SIGINT and is waited for; ``returncode`` and
    ``output`` are filled in then. Needs the ``openai`` package."""
    import openai

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tracerl", "serve", "--model", str(model), "--store", str(store),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    served = ServedProcess(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                         max_retries=0, timeout=30), process)
    try:
        deadline = time.monotonic() + start_seconds
        while True:
            try:
                served.client.models.list()
                break
            except openai.APIConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("tracerl serve did not start") from None
                time.sleep(0.2)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        served.output, _ = process.communicate(timeout=60)
        served.returncode = process.returncode
