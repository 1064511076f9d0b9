"""Ray backend: the same collector, with environments (and optionally the policy) in Ray actors.

Nothing about attempts changes: ``Collector`` runs exactly as locally, and ``RayEnvPool.make_env``
is the environment factory it is given. Each environment lives in an ``EnvHost`` actor (a Ray
worker process, on this machine or any node of a cluster); the collector's thread pool calls
``reset``/``step``/``verify``/``audit``/``close`` on a thin proxy that forwards them. Seeds,
prompts and token bookkeeping stay in the collector, so a run gives the same attempts under
the same seeds as the local backend.

Faults: when a host actor dies (``ray.kill``, a crashed node, an OOM kill), every call to it
raises ``EnvActorDied`` (a ``RuntimeError``), which the collector records as ``tool_error`` for
the attempts that were on it: infrastructure, never the policy's fault. The pool starts a
replacement host at once, so the attempts that follow run normally and the run goes on.

``RayPolicy`` puts the policy in an actor too (e.g. on a GPU node); its ``generate`` has the
signature the collector's batcher uses. If that actor dies there is nothing left to sample
with: ``generate`` raises ``PolicyActorDied``.

Ray is an extra (``pip install 'tracerl[ray]'``) and is imported only when used.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracerl.rollout.policies.sampling import Completion, SamplingParams


class EnvActorDied(RuntimeError):
    """The actor hosting an environment died; its attempt ends ``tool_error``."""


class PolicyActorDied(RuntimeError):
    """The actor hosting the policy died; nothing can be sampled until it is replaced."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError("the Ray backend needs ray: pip install 'tracerl[ray]'") from error
    return ray


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             **kwargs: Any) -> None:
    """Start Ray locally (``address=None``) or join a cluster (``"ray://host:10001"``, ``"auto"``).

    Does nothing if Ray is already initialised in this process.
    """
    ray = _ray()
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)


class EnvHost:
    """Actor body: keeps several environments by key and runs their calls (threaded actor)."""

    def __init__(self, make_env: Callable[[], Any]) -> None:
        self._make_env = make_env
        self._envs: dict[str, Any] = {}
        self._lock = threading.Lock()

    def reset(self, key: str, seed: int | None, options: Mapping[str, Any] | None
              ) -> tuple[Any, Any, tuple[str, ...]]:
        """Make the environment for ``key`` if needed and reset it; also its optional methods."""
        with self._lock:
            env = self._envs.get(key)
        if env is None:
            env = self._make_env()
            with self._lock:
                self._envs[key] = env
        observation, info = env.reset(seed=seed, options=dict(options or {}))
        methods = tuple(n for n in ("verify", "audit") if callable(getattr(env, n, None)))
        return observation, info, methods

    def step(self, key: str, action: Any) -> Any:
        return self._env(key).step(action)

    def call(self, key: str, name: str) -> Any:
        if name not in ("verify", "audit"):
            raise ValueError(f"call: {name!r} is not an environment method the host forwards")
        return getattr(self._env(key), name)()

    def close(self, key: str) -> None:
        with self._lock:
            env = self._envs.pop(key, None)
        close = getattr(env, "close", None)
        if callable(close):
            close()

    def tool_schemas(self) -> Any:
        env = self._make_env()
        try:
            return getattr(env, "tool_schemas", None)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                close()

    def pid(self) -> int:
        return os.getpid()

    def _env(self, key: str) -> Any:
        with self._lock:
            env = self._envs.get(key)
        if env is None:
            raise RuntimeError(f"environment {key!r} was never reset on this host")
        return env


class RayEnvPool:
    """``num_hosts`` ``EnvHost`` actors; ``make_env`` gives the collector a proxy per attempt.

    Args:
        make_env: factory of one environment; pickled to the actors (use importable callables
            or ``functools.partial``; closures over test-local classes need
            ``cloudpickle.register_pickle_by_value``).
        num_hosts: actors; attempts are placed on them round-robin.
        env_concurrency: calls one host runs at once (its thread count); match the collector's
            ``env_workers`` / ``num_hosts``.
        num_cpus: CPUs Ray reserves per host (placement on a cluster).
    """

    def __init__(self, make_env: Callable[[], Any], *, num_hosts: int = 2,
                 env_concurrency: int = 4, num_cpus: float = 1.0) -> None:
        if num_hosts < 1:
            raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
        if env_concurrency < 1:
            raise ValueError(f"env_concurrency must be >= 1, got {env_concurrency}")
        if num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
        ray = _ray()
        if not ray.is_initialized():
            raise ValueError("Ray is not initialised: call init_ray() (or ray.init()) first")
        self._actor_class = ray.remote(EnvHost).options(
            max_concurrency=env_concurrency, num_cpus=num_cpus)
        self._make_env = make_env
        self._lock = threading.Lock()
        self.hosts: list[Any] = [self._actor_class.remote(make_env) for _ in range(num_hosts)]
        """Live host actors (a dead one is replaced in place)."""
        self.replaced = 0
        """Hosts found dead and replaced."""
        self._next = itertools.count()
        self._tool_schemas: Any = None
        self._placements: dict[str, Any] = {}

    def make_env(self) -> RayEnv:
        """A proxy environment for the collector (no remote call until ``reset``)."""
        return RayEnv(self)

    def placement(self, key: str) -> Any:
        """The host actor of environment ``key`` (None before its reset)."""
        with self._lock:
            return self._placements.get(key)

    def _place(self, key: str) -> Any:
        with self._lock:
            host = self.hosts[next(self._next) % len(self.hosts)]
            self._placements[key] = host
            return host

    def _unplace(self, key: str) -> None:
        with self._lock:
            self._placements.pop(key, None)

    def _replace(self, dead: Any) -> None:
        with self._lock:
            for i, host in enumerate(self.hosts):
                if host._actor_id == dead._actor_id:
                    self.hosts[i] = self._actor_class.remote(self._make_env)
                    self.replaced += 1

    def get(self, ref: Any, host: Any, what: str) -> Any:
        """``ray.get`` that turns a dead host into ``EnvActorDied`` (and replaces the host)."""
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as error:
            self._replace(host)
            raise EnvActorDied(f"the Ray actor hosting the environment died during {what} "
                               f"({type(error).__name__})") from error

    def tool_schemas(self) -> Any:
        """The environment's ``tool_schemas`` (asked of one host once)."""
        if self._tool_schemas is None:
            host = self.hosts[0]
            self._tool_schemas = self.get(host.tool_schemas.remote(), host, "tool_schemas")
        return self._tool_schemas

    def shutdown(self) -> None:
        """Kill every host actor."""
        ray = _ray()
        with self._lock:
            hosts, self.hosts = list(self.hosts), []
        for host in hosts:
            ray.kill(host)

    def __enter__(self) -> RayEnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class RayEnv:
    """The collector-side proxy of one environment living in an ``EnvHost`` actor."""

    def __init__(self, pool: RayEnvPool) -> None:
        self._pool = pool
        self._key = uuid.uuid4().hex
        self._host: Any = None
        self._methods: tuple[str, ...] = ()

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
              ) -> tuple[Any, Any]:
        host = self._host = self._pool._place(self._key)
        observation, info, self._methods = self._pool.get(
            host.reset.remote(self._key, seed, dict(options or {})), host, "reset")
        return observation, info

    def step(self, action: Any) -> Any:
        host = self._checked_host()
        return self._pool.get(host.step.remote(self._key, action), host, "step")

    def close(self) -> None:
        host, self._host = self._host, None
        self._pool._unplace(self._key)
        if host is None:
            return
        with contextlib.suppress(EnvActorDied):  # a dead host has nothing left to close
            self._pool.get(host.close.remote(self._key), host, "close")

    def __getattr__(self, name: str) -> Any:
        # verify/audit exist only when the hosted environment has them, as locally.
        if name in ("verify", "audit") and name in self.__dict__.get("_methods", ()):
            def forward() -> Any:
                host = self._checked_host()
                return self._pool.get(host.call.remote(self._key, name), host, name)
            return forward
        if name == "tool_schemas":
            return self.__dict__["_pool"].tool_schemas()
        raise AttributeError(name)

    def _checked_host(self) -> Any:
        if self._host is None:
            raise RuntimeError("the environment was not reset (or is closed)")
        return self._host


class PolicyHost:
    """Actor body: holds the policy a factory builds (e.g. ``HFPolicy.from_pretrained``)."""

    def __init__(self, make_policy: Callable[[], Any]) -> None:
        self.policy = make_policy()

    def info(self) -> dict[str, Any]:
        return {"engine": str(getattr(self.policy, "engine", "hf")),
                "policy_version": int(self.policy.policy_version),
                "context_length": getattr(self.policy, "context_length", None)}

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 row_seeds: Sequence[int] | None = None) -> list[Completion]:
        if row_seeds is None:
            return list(self.policy.generate(prompts, params))
        return list(self.policy.generate(prompts, params, row_seeds=row_seeds))

    def chat_prompt(self, messages: Any, tools: Any, add_generation_prompt: bool) -> list[int]:
        return list(self.policy.chat_prompt(messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.policy.decode(token_ids))

    def load_state_dict(self, state: Mapping[str, Any], policy_version: int) -> int:
        self.policy.model.load_state_dict(state)
        self.policy.policy_version = policy_version
        return policy_version


class RayPolicy:
    """A policy in a Ray actor (``num_gpus`` for a GPU node), usable by the collector."""

    def __init__(self, make_policy: Callable[[], Any], *, num_cpus: float = 1.0,
                 num_gpus: float = 0.0) -> None:
        ray = _ray()
        if not ray.is_initialized():
            raise ValueError("Ray is not initialised: call init_ray() (or ray.init()) first")
        self.actor = ray.remote(PolicyHost).options(
            num_cpus=num_cpus, num_gpus=num_gpus).remote(make_policy)
        info = self._get(self.actor.info.remote())
        self.engine: str = info["engine"]
        """Engine of the hosted policy."""
        self.policy_version: int = info["policy_version"]
        """Version of the hosted weights (updated by ``load_state_dict``)."""
        self.context_length: int | None = info["context_length"]
        """The hosted model's context length."""

    def _get(self, ref: Any) -> Any:
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as error:
            raise PolicyActorDied(f"the Ray actor hosting the policy died "
                                  f"({type(error).__name__})") from error

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 row_seeds: Sequence[int] | None = None) -> list[Completion]:
        """As ``HFPolicy.generate``, run in the actor."""
        return list(self._get(self.actor.generate.remote(
            [list(p) for p in prompts], params, None if row_seeds is None else list(row_seeds))))

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return list(self._get(self.actor.chat_prompt.remote(
            [dict(m) for m in messages], [dict(t) for t in tools] if tools else None,
            add_generation_prompt)))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._get(self.actor.decode.remote(list(token_ids))))

    def load_state_dict(self, state: Mapping[str, Any], policy_version: int) -> None:
        """Load new weights into the hosted model and stamp them ``policy_version``."""
        self.policy_version = int(self._get(self.actor.load_state_dict.remote(
            dict(state), policy_version)))
