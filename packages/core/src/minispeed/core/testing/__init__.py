"""Run a test body on N gloo processes: `run_distributed` and `@distributed_test`.

```python
from minispeed.core.testing import distributed_test, run_distributed

def _body(rank: int, world_size: int, x: int) -> float:   # module level; group is ready
    t = torch.tensor([float(rank + x)])
    comm.all_reduce(t)
    return t.item()

def test_sum():
    assert run_distributed(_body, world_size=2, args=(3,)) == [7.0, 7.0]

@distributed_test(world_size=[2, 4])        # two tests: test_other[ws2], test_other[ws4]
def test_other(rank, world_size):
    ...
```

Design, and what it costs:

- **Processes.** Each rank is a real process (`spawn`), so process groups, globals and
  collectives behave as under torchrun. Each process sees `RANK`, `WORLD_SIZE`,
  `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1` and `MASTER_PORT`, a default
  process group over all ranks (`backend`, timeout `timeout_s` + 10 s), one torch thread and
  `MINISPEED_ACCELERATOR=cpu` (override with `env=`). The group is destroyed after the
  body, also when it raises.
- **A warm pool** (`.pool`, Note [why a pool]; one process per rank slot, `.process`;
  the loop inside each, `.worker`): the processes are spawned once per pytest
  session, import torch once (~2 s of CPU each, N processes × one import), and serve every later
  run, so a warm trivial 2-rank run costs a rendezvous (~tens of ms), not two torch imports.
  Workers are reused only after a clean teardown; after a hang, a crash or a leaked group the
  affected processes are killed and re-spawned, so each run starts clean.
- **Finding the body** (`.function_ref`): workers receive (module, file, qualname) and load
  the test file themselves, so bodies must be module-level functions (no lambdas or closures);
  arguments, return values and exceptions travel by pickle.
- **Failures** (`.errors`): a raising rank gives `DistributedTestError` with its
  traceback, every line tagged `[rank N]`; a dead process is reported at once with its exit
  code or signal; after `timeout_s` a hang is reported with the ranks that finished, those that
  did not, and the Python stack of each unfinished rank. The suite never hangs.

Limits: one run at a time per process; no nesting (a body cannot call `run_distributed`);
environment variables read by torch at import time (`OMP_NUM_THREADS`...) are fixed when the
pool starts; pytest fixtures are not available inside a body.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from minispeed.core.testing.errors import DistributedTestError
from minispeed.core.testing.function_ref import BODY_ATTR, FunctionRef
from minispeed.core.testing.pool import get_pool, shutdown_pool
from minispeed.core.testing.worker import MASTER_ADDR, WORKER_ENV, Task

__all__ = [
    "DistributedTestError",
    "distributed_test",
    "run_distributed",
    "shutdown_pool",
    "worker_pids",
]

_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _check_backend(backend: object) -> None:
    import torch.distributed as dist  # the harness's exception to "only comm imports it"

    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    if backend not in known:
        raise ValueError(
            f"backend={backend!r} is not a torch.distributed backend; use one of {known}"
        )


def _worker_environ(rank: int, world_size: int, env: Mapping[str, str] | None) -> dict[str, str]:
    """The body's environment: ours, CPU by default, torchrun's variables, then the caller's."""
    environ = dict(os.environ)
    environ["MINISPEED_ACCELERATOR"] = "cpu"
    for key, value in (env or {}).items():
        if key in _TORCHRUN_VARS:
            raise ValueError(f"env= may not set {key}: the harness sets it per rank")
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env= needs str keys and values, got {key!r}: {value!r}")
        environ[key] = value
    environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=MASTER_ADDR,
    )
    environ.pop("MASTER_PORT", None)  # set in the worker once rank 0 has opened the store
    return environ


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` processes; return per-rank results.

    `fn` must be a module-level function (workers look it up by module and name). `args`,
    `kwargs` and the return values travel by pickle: return CPU tensors or Python values.
    `timeout_s` bounds the run from dispatch to the last rank's reply (the process group's own
    timeout is 10 s longer, a backstop, so the parent reports a hang first); starting missing workers (a torch import each) is not counted against it
    and has its own limit, `pool.STARTUP_TIMEOUT_S`. `env` adds or overrides environment variables for the body (e.g.
    `{"MINISPEED_ACCELERATOR": "cuda"}`). Raises `DistributedTestError` if any rank
    raises, dies, hangs, or returns something unpicklable; the list is in rank order otherwise.
    """
    if os.environ.get(WORKER_ENV):
        raise RuntimeError(
            "run_distributed was called inside a test worker; bodies cannot nest runs: call "
            "the inner body's code directly, the process group is already initialized"
        )
    world_size = _check_world_size(world_size)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    _check_backend(backend)
    ref = FunctionRef.of(fn)
    args, kwargs = tuple(args), dict(kwargs or {})
    body = getattr(fn, BODY_ATTR, fn)
    try:
        inspect.signature(body).bind(0, world_size, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"{ref} cannot be called as fn(rank, world_size, *args, **kwargs) with the given "
            f"args/kwargs: {exc}; its signature is {inspect.signature(body)}"
        ) from None
    except ValueError:
        pass  # no signature to check (a builtin); the worker reports any mismatch
    try:
        payload = pickle.dumps((args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"args/kwargs for {ref} cannot be pickled ({type(exc).__name__}: {exc}); pass plain "
            "values, CPU tensors, or module-level classes and functions"
        ) from exc
    environs = [_worker_environ(rank, world_size, env) for rank in range(world_size)]
    sys_path, cwd = list(sys.path), os.getcwd()

    def make_task(rank: int, master_port: int | None) -> Task:
        return Task(
            rank=rank,
            world_size=world_size,
            fn=ref,
            payload=payload,
            backend=backend,
            timeout_s=float(timeout_s),
            environ=environs[rank],
            sys_path=sys_path,
            cwd=cwd,
            master_port=master_port,
        )

    raw = get_pool().run(make_task, world_size, float(timeout_s), label=f"run_distributed({ref})")
    results = []
    for rank, data in enumerate(raw):
        try:
            results.append(pickle.loads(data))
        except Exception as exc:
            raise DistributedTestError(
                f"rank {rank}'s return value from {ref} could not be unpickled in the calling "
                f"process ({type(exc).__name__}: {exc}); return plain Python values or CPU tensors",
                finished=range(world_size),
            ) from exc
    return results


def distributed_test(
    world_size: int | Sequence[int] = 2,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorate `def test_x(rank, world_size)` to run it on every rank, once per world size.

    The decorated test is parametrized over `world_size` (ids `ws2`, `ws4`...), so pytest
    selects it as `test_x[ws2]`. The body must be at module level; it gets no fixtures and no
    other parameters (pass data through module-level constants, or use run_distributed with
    args=). Marks applied above or below the decorator are kept. Failures raise `DistributedTestError`.
    """
    sizes = [world_size] if isinstance(world_size, int) else list(world_size)
    if not sizes:
        raise ValueError("distributed_test needs at least one world size, e.g. world_size=[2, 4]")
    sizes = [_check_world_size(n) for n in sizes]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"distributed_test got repeated world sizes {sizes}; list each once")

    def decorate(body: Callable[..., Any]) -> Callable[..., None]:
        try:
            inspect.signature(body).bind(0, 1)
        except TypeError:
            raise TypeError(
                f"@distributed_test body {body.__qualname__}{inspect.signature(body)} must accept "
                "(rank, world_size)"
            ) from None
        FunctionRef.of(body, check_reachable=False)  # lambdas and closures fail here, early

        def test(world_size: int) -> None:
            run_distributed(
                body, world_size=world_size, timeout_s=timeout_s, backend=backend, env=env
            )

        functools.update_wrapper(test, body)  # name, module, doc, and marks applied below us
        # pytest reads the signature to find parameters; show it world_size, not (rank, world_size).
        test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                inspect.Parameter(
                    "world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int
                )
            ]
        )
        setattr(test, BODY_ATTR, body)
        import pytest  # only needed where tests are collected

        return pytest.mark.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])(test)

    return decorate


def worker_pids() -> dict[int, int]:
    """`{rank slot: pid}` of the idle pool workers; lets tests check that processes are reused."""
    return get_pool().worker_pids()
