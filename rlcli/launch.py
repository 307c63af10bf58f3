"""Start N ranks of a training run from inside the CLI, the way ``torchrun`` does.

``rlcli train RECIPE --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]``
uses PyTorch's elastic launcher (no Ray, no home-made process manager): one process per GPU, or
N gloo ranks on CPU. Single node: a local c10d rendezvous on a free port. Several nodes: a static
rendezvous at ``A:P`` where this machine is node ``R``, exactly as with torchrun. A rank that
fails ends the whole run, and its traceback is printed by the parent.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class LaunchSpec:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def check(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError("--nproc-per-node and --nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError("--nnodes > 1 needs --master-addr and --master-port (the address of node 0)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank raised; the message holds the failing ranks' errors and tracebacks, ``errors`` each
    failing rank's ``Type: message`` line."""

    def __init__(self, message: str, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.errors = errors or {}


def launch(spec: LaunchSpec, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on every local rank; return the local ranks' return values."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec.check()
    if spec.nnodes == 1:
        addr = spec.master_addr or "127.0.0.1"
        endpoint = f"{addr}:{spec.master_port or free_port()}"
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_configs={})
    else:
        endpoint = f"{spec.master_addr}:{spec.master_port}"
        rdzv = dict(rdzv_backend="static", rdzv_endpoint=endpoint, rdzv_configs={"rank": spec.node_rank})
    env = os.environ.copy()
    if "OMP_NUM_THREADS" not in env:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node))
    # Every node of a run must name the same run id (the rendezvous store's key prefix): a random
    # one per node would leave the nodes waiting for each other forever.
    run_id = f"rlcli-{uuid.uuid4().hex[:8]}" if spec.nnodes == 1 else f"rlcli-{spec.master_addr}-{spec.master_port}"
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
        run_id=run_id, max_restarts=0, start_method="spawn",
        monitor_interval=0.5, **rdzv,
    )
    try:
        return elastic_launch(config, fn)(*args)
    except ChildFailedError as exc:
        lines, errors = [], {}
        for r, failure in sorted(exc.failures.items()):
            msg = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
            tb = ""
            if isinstance(failure.message, dict):
                tb = failure.message.get("extraInfo", {}).get("py_callstack", "")
            lines.append(f"rank {r} (exit code {failure.exitcode}): {msg}\n{tb}".rstrip())
            errors[r] = msg
        raise RankFailed("\n".join(lines) or str(exc), errors) from None
    finally:
        if "OMP_NUM_THREADS" not in env:
            os.environ.pop("OMP_NUM_THREADS", None)
