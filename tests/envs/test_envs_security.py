"""One attack per test, each run from inside the sandbox; each must be contained."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import uuid
from pathlib import Path

from tracerl.envs.coding import CodingEnv
from tracerl.envs.sandbox import Sandbox, SandboxLimits
from tracerl.envs.tasks import Task


def _py(code: str) -> list[str]:
    return ["python", "-c", code]


def _host_processes_with(marker: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and "pytest" not in cmdline:
            found.append(cmdline)
    return found


def test_cannot_connect_to_host_loopback_listener(sandbox: Sandbox, tmp_path: Path) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3.0)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    code = ("import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'stolen')\nprint('CONNECTED')\n")
    result = sandbox.run(tmp_path, _py(code))
    thread.join()
    server.close()
    assert result.exit_code != 0
    assert "CONNECTED" not in result.stdout
    assert "OSError" in result.stderr or "Error" in result.stderr
    assert accepted == []  # the host's listener never saw a connection


def test_cannot_write_outside_workspace(sandbox: Sandbox, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    marker = f"tracerl-escape-{uuid.uuid4().hex}"
    code = (
        "import os\n"
        f"for target in [{str(outside / 'x')!r}, '/usr/{marker}', '/etc/{marker}', "
        f"'/{marker}', '../{marker}']:\n"
        "    try:\n"
        "        open(target, 'w').write('x')\n"
        "        print('WROTE', target)\n"
        "    except OSError as error:\n"
        "        print('DENIED', target, type(error).__name__)\n"
        f"open('/tmp/{marker}', 'w').write('private tmp')\n"
    )
    result = sandbox.run(workspace, _py(code))
    assert "WROTE" not in result.stdout, result.stdout
    assert result.stdout.count("DENIED") == 5
    assert not (outside / "x").exists()
    assert not Path(f"/tmp/{marker}").exists()  # the sandbox's /tmp is its own
    assert not (tmp_path / marker).exists()


def test_cannot_read_host_home(sandbox: Sandbox, tmp_path: Path) -> None:
    secret_text = f"secret-{uuid.uuid4().hex}"
    secret = Path.home() / f".tracerl-test-secret-{uuid.uuid4().hex}"
    secret.write_text(secret_text)
    secret.chmod(0o644)  # readable by anyone on the host: only the sandbox should stop it
    try:
        code = ("import os\n"
                f"try:\n    print(open({str(secret)!r}).read())\n"
                "except OSError as error:\n    print('DENIED', type(error).__name__)\n"
                f"print('LISTING', os.listdir('/') )\n")
        result = sandbox.run(tmp_path, _py(code))
    finally:
        secret.unlink()
    assert secret_text not in result.stdout
    assert "DENIED FileNotFoundError" in result.stdout


def _search_task() -> Task:
    token = "HIDDEN-ANSWER-7f3a"
    return Task(
        id="search", family="attack", instruction="Find the hidden tests.",
        files={"mod.py": "x = 1\n"}, protected=(), test_command="python mod.py",
        hidden_files={"test_hidden_mod.py": f"# {token}\nimport mod\n"},
        hidden_test_command="python test_hidden_mod.py",
    )


def test_cannot_find_hidden_tests(sandbox: Sandbox) -> None:
    search = (
        "import os, sys\n"
        "hits = []\n"
        "skip = {'/proc', '/sys', '/dev', '/usr', sys.prefix, sys.base_prefix}\n"
        "for dirpath, dirnames, filenames in os.walk('/'):\n"
        "        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]\n"
        "        for name in filenames:\n"
        "            path = os.path.join(dirpath, name)\n"
        "            if 'hidden' in name:\n"
        "                hits.append(path)\n"
        "            elif name.endswith(('.jsonl', '.json')) and os.path.getsize(path) < 10**7:\n"
        "                try:\n"
        "                    if 'HIDDEN-ANSWER' in open(path, errors='ignore').read():\n"
        "                        hits.append(path)\n"
        "                except OSError:\n"
        "                    pass\n"
        "try:\n"
        "    import tracerl.envs.suite\n"
        "    hits.append('tracerl importable')\n"
        "except ImportError:\n"
        "    pass\n"
        "if hits:\n"
        "    print('FAIL found', hits[:3])\n"
        "    raise SystemExit(1)\n"
    )
    env = CodingEnv([_search_task()], sandbox=sandbox)
    env.reset(seed=0)
    call = {"name": "write_file", "arguments": {"path": "mod.py", "content": search}}
    assert env.step(f"<tool_call>{json.dumps(call)}</tool_call>")[0] == "OK"
    observation, _, _, _, info = env.step('<tool_call>{"name": "run_tests"}</tool_call>')
    env.close()
    assert not info["tool_error"]
    assert observation == "PASS", observation


def test_fork_bomb_is_contained(tmp_path: Path) -> None:
    sandbox = Sandbox(SandboxLimits(wall_seconds=3.0, max_processes=16))
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = sandbox.run(tmp_path, _py(code))
    assert result.killed_reason in ("processes", "timeout", "cpu")
    assert result.seconds < 20
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    leftover = _host_processes_with("os.fork()")
    assert leftover == []


def test_memory_bomb_is_contained(sandbox: Sandbox, tmp_path: Path) -> None:
    result = sandbox.run(tmp_path, _py("x = bytearray(8 << 30)\nprint('ALLOCATED')"))
    assert "ALLOCATED" not in result.stdout
    assert result.exit_code != 0
    assert result.killed_reason == "memory"


def test_infinite_loop_is_killed_by_the_wall_clock(tmp_path: Path) -> None:
    sandbox = Sandbox(SandboxLimits(wall_seconds=1.5, cpu_seconds=30))
    result = sandbox.run(tmp_path, _py("while True:\n    pass\n"))
    assert result.timed_out
    assert result.killed_reason == "timeout"
    assert result.seconds < 10


def test_cpu_limit_stops_a_busy_loop(tmp_path: Path) -> None:
    sandbox = Sandbox(SandboxLimits(wall_seconds=30, cpu_seconds=1))
    result = sandbox.run(tmp_path, _py("while True:\n    pass\n"))
    assert not result.timed_out
    assert result.killed_reason == "cpu"


def test_background_processes_do_not_survive(sandbox: Sandbox, tmp_path: Path) -> None:
    marker_a, marker_b = "417.25", "418.75"
    command = (f"sleep {marker_a} & (setsid nohup sleep {marker_b} > /dev/null 2>&1 &); "
               "echo started")
    result = sandbox.run(tmp_path, command)
    assert result.exit_code == 0 and "started" in result.stdout
    assert _host_processes_with(f"sleep {marker_a}") == []
    assert _host_processes_with(f"sleep {marker_b}") == []


def test_planted_link_is_not_followed_by_host_side_tools(sandbox: Sandbox, tmp_path: Path) -> None:
    # Test code runs in the sandbox, but view_file runs on the host: a link planted by the
    # former must not let the latter read host files.
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret")
    task = Task(id="link", family="attack", instruction="x", files={"mod.py": "x = 1\n"},
                protected=(), test_command=f"ln -s {secret} leak.txt; ln -s / root",
                hidden_files={"h.py": ""}, hidden_test_command="true")
    env = CodingEnv([task], sandbox=sandbox)
    env.reset(seed=0)
    env.step('<tool_call>{"name": "run_tests"}</tool_call>')
    assert env.workspace is not None and (env.workspace.root / "leak.txt").is_symlink()
    for path in ("leak.txt", f"root{secret}"):
        call = {"name": "view_file", "arguments": {"path": path}}
        observation, _, _, _, info = env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
        assert "host secret" not in observation
        assert observation.startswith("error:") and not info["tool_error"]
    env.close()


def test_runs_as_an_unprivileged_user(sandbox: Sandbox, tmp_path: Path) -> None:
    result = sandbox.run(tmp_path, _py("import os; print(os.getuid(), os.getgid())"))
    uid, gid = map(int, result.stdout.split())
    assert uid != 0 and gid != 0
