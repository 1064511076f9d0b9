"""The agent's world: tasks, a sandbox, tools, the environment, the verifier and the audit.

``envs`` knows nothing of training or of trace records: it returns its own small frozen
records (``VerifyResult``, ``AuditResult``, ``SandboxResult``) for a collector to map.
"""

from __future__ import annotations

from tracerl.envs.audit import AuditResult, VerifyResult, audit_attempt, verify_files
from tracerl.envs.coding import CodingEnv
from tracerl.envs.faults import FaultConfig, FaultInjector
from tracerl.envs.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxStartError,
    SandboxUnavailableError,
)
from tracerl.envs.tasks import Budget, Task, TaskCheck, dump_tasks, load_tasks, validate_task
from tracerl.envs.tools import TOOL_NAMES, TOOL_SCHEMAS, ToolCall, parse_tool_call
from tracerl.envs.verdict import REPORT_SOURCE, Verdict, run_verdict

__all__ = [
    "REPORT_SOURCE", "TOOL_NAMES", "TOOL_SCHEMAS", "AuditResult", "Budget", "CodingEnv",
    "FaultConfig", "FaultInjector", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxStartError",
    "SandboxUnavailableError", "Task", "TaskCheck", "ToolCall", "Verdict", "VerifyResult",
    "audit_attempt", "dump_tasks", "load_tasks", "parse_tool_call", "run_verdict",
    "validate_task", "verify_files",
]
