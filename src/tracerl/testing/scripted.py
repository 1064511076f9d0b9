"""A scripted policy: replays fixed tool calls per task through the real collector.

It checks the evaluation pipeline end to end with a known answer. Replaying each task's
``solution`` must score 1 on every task (anything less means a broken task, sandbox or
verifier); replaying an edit of a protected test must be flagged by the audit and never
counted as a success. With ``retries`` it also tries a call again when the tool answered
with a failure (how a policy recovers from a tool fault). It renders prompts and tokens with a real policy's tokenizer and chat
template, so the collector records it exactly as it records a model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracerl.envs.tasks import Task
from tracerl.hermes import render_tool_call
from tracerl.rollout.policies.hf import HFPolicy
from tracerl.rollout.policies.sampling import Completion, SamplingParams

Script = Callable[[Task], list[str]]
"""Builds the texts of a task's actions, in order."""

FAILURE_MARKS = ("error:", "FAIL", "[output truncated]", "tool error")
"""Text in an observation that makes a retrying policy call the same tool again."""


def solution_script(task: Task) -> list[str]:
    """Write every file of the task's ``solution``, then submit."""
    if task.solution is None:
        raise ValueError(f"task {task.id}: has no solution to replay")
    return [render_tool_call("write_file", {"path": path, "content": content})
            for path, content in sorted(task.solution.items())] + [
        render_tool_call("submit", {})]


def protected_edit_script(task: Task) -> list[str]:
    """Overwrite the first protected file with a test that always passes, then submit."""
    protected = sorted(task.protected_files())
    if not protected:
        raise ValueError(f"task {task.id}: has no protected file to edit")
    return [render_tool_call("write_file", {"path": protected[0], "content": "pass\n"}),
            render_tool_call("run_tests", {}), render_tool_call("submit", {})]


class ScriptedPolicy:
    """Answers each prompt with the next action of its task's script (behavior logprob 0:
    the action is certain, a point mass)."""

    engine = "scripted"

    def __init__(self, base: HFPolicy, tasks: Sequence[Task], script: Script, *,
                 retries: int = 0) -> None:
        """``retries``: how many times an action whose observation shows a failure
        (``FAILURE_MARKS``) is sent again before the script moves on."""
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.retries = retries
        self.base = base
        self.tasks = list(tasks)
        self.scripts: dict[str, list[str]] = {task.id: script(task) for task in self.tasks}
        self.policy_version = base.policy_version
        self.context_length = base.context_length
        eos = getattr(base.tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ValueError("scripted policy: the base tokenizer has no eos_token_id")
        self._eos = eos

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return self.base.chat_prompt(messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.base.decode(token_ids)

    def _task_of(self, text: str) -> Task:
        # The first observation holds the instruction and the file list.
        found = [t for t in self.tasks
                 if t.instruction in text and all(path in text for path in t.files)]
        if len(found) != 1:
            raise ValueError(f"scripted policy: prompt matches {len(found)} tasks, expected 1")
        return found[0]

    def next_action(self, text: str) -> str:
        """The action to answer the conversation ``text`` with: the first of its task's script
        that the conversation does not hold yet, or, with ``retries``, the last action again
        when what came back shows a failure."""
        script = self.scripts[self._task_of(text).id]
        if self.retries:
            last = max(script, key=text.rfind)
            at = text.rfind(last)
            answer = text[at + len(last):]
            if at >= 0 and any(mark in answer for mark in FAILURE_MARKS) \
                    and text.count(last) <= self.retries:
                return last
        return next((a for a in script if a not in text), script[-1])

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 **_: Any) -> list[Completion]:
        out = []
        tokenizer = self.base.tokenizer
        for prompt in prompts:
            action = self.next_action(str(tokenizer.decode(list(prompt),
                                                           skip_special_tokens=False)))
            ids = [*tokenizer.encode(action, add_special_tokens=False), self._eos]
            # The generation cap binds a script as it binds a model: a cut action is recorded
            # cut, and the environment sees the broken call.
            cut = len(ids) > params.max_new_tokens
            ids = ids[: params.max_new_tokens]
            out.append(Completion(tuple(ids), tuple(0.0 for _ in ids),
                                  "length" if cut else "stop", self.base.decode(ids),
                                  None if cut else self._eos, self.policy_version))
        return out
