"""Process-group setup: join a torchrun/elastic job, or run as a single-process group.

The trainer always runs under FSDP2, even alone, so that one code path covers one process and
many. Without a launcher environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` unset),
:func:`init_distributed` creates a one-rank group on an in-memory ``HashStore``: no port, no
file, nothing that can collide with another run on the same machine.

Backends: gloo on CPU; on CUDA, NCCL for CUDA tensors plus gloo for CPU tensors (one group).

Sub-groups (a disaggregated run trains on some ranks and rolls out on others): :func:`new_group`
creates one with the same backends (every rank of the job must call it, in the same order), and
:func:`group_mesh` turns it into the 1-D ``("dp",)`` mesh FSDP2 shards over; :func:`barrier`
takes an optional group (default: the whole job).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
_MESH: DeviceMesh | None = None
_OWNED = False  # whether init_distributed created the default group (and so may destroy it)


def launched() -> bool:
    """Whether this process was started by torchrun / an elastic agent."""
    return all(os.environ.get(v) for v in _LAUNCHER_VARS)


def _backend(device: torch.device) -> str:
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device | str = "cpu") -> tuple[int, int]:
    """Join the launcher's process group or create a single-process one; returns ``(rank, world_size)``.

    Idempotent: if a default group already exists it is reused as is. On CUDA the current device
    is set to ``LOCAL_RANK`` (falling back to the rank modulo the visible device count).
    """
    global _OWNED
    device = torch.device(device)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if launched():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local)
        dist.init_process_group(_backend(device), init_method="env://", rank=rank, world_size=world)
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else 0)
        dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    _OWNED = True
    return dist.get_rank(), dist.get_world_size()


def destroy() -> None:
    """Tear down the default group if :func:`init_distributed` created it (no-op otherwise).

    For an orderly end only: every rank calls it, and it waits for all of them first, so that no
    rank closes its connections while a peer may still have work in flight on them."""
    global _OWNED, _MESH
    _MESH = None
    if _OWNED and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
    _OWNED = False


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """True on rank 0, and in a process without a process group."""
    return rank() == 0


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (default: the whole job); a no-op alone."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def new_group(ranks: list[int], device: torch.device | str = "cpu", *, cpu_only: bool = False,
              timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A process group of ``ranks`` (global ranks, any order; stored sorted).

    Collective over the whole job: every rank calls it, members or not, with the same arguments
    and in the same order as every other ``new_group``. Backends as the default group (gloo on
    CPU; NCCL for CUDA tensors plus gloo for CPU tensors on CUDA), or gloo alone with
    ``cpu_only`` (for Python objects and small control messages). ``timeout``: how long an
    operation of the group may wait for its peers (default: the default group's). Non-members get
    a placeholder they must not use.
    """
    backend = "gloo" if cpu_only else _backend(torch.device(device))
    return dist.new_group(sorted(ranks), backend=backend, timeout=timeout)


def group_mesh(group: dist.ProcessGroup, device: torch.device | str = "cpu") -> DeviceMesh:
    """The 1-D data-parallel mesh (``("dp",)``) over the ranks of ``group`` (members only; no collective)."""
    device = torch.device(device)
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


def device_mesh(device: torch.device | str = "cpu") -> DeviceMesh:
    """The 1-D data-parallel mesh (``("dp",)``) over every rank, built once per process group."""
    global _MESH
    device = torch.device(device)
    if not dist.is_initialized():
        init_distributed(device)
    if _MESH is None or _MESH.device_type != device.type:
        _MESH = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return _MESH


def local_device(device: torch.device | str) -> torch.device:
    """``cuda`` resolved to this rank's current CUDA device; other devices unchanged."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
