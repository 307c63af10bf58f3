"""How the train ranks and the rollout ranks of a disaggregated run talk: torch.distributed only.

Every rank of the job creates the same process groups, in the same order (:meth:`Channels.create`):

``train``     the train ranks; FSDP2 shards over it, train rank 0 hands out work on it (device backend)
``command``   train rank 0 + the rollout ranks; commands from train rank 0, point to point (gloo)
``reply``     the same ranks; answers from the rollout ranks to train rank 0, point to point (gloo)
``weights``   the same ranks; weight buckets broadcast from train rank 0 (device backend: NCCL on GPU)

Commands and replies (the message classes of :mod:`rlcli.runner.disaggregated.protocol`) are
pickled Python objects (a size, then the bytes) on two groups of their own, so a rollout rank's
blocking wait for the next command never shares a communicator with its answers or with a weight
transfer. Nothing restricts what is unpickled: every peer is a rank of the same job, launched
together from the same code. A weight update is a sequence of buckets, each announced by a small
manifest (names, dtypes, shapes, offsets, policy version) and then sent as one flat byte buffer of
bounded size; an empty manifest ends the update.

Failures are loud, not silent: a rank that raises first sends a :class:`RemoteError` (with its
traceback, bounded wait) to the peer it works with, then exits, and the launcher stops every other
rank. A rank whose peer vanished raises :class:`PeerLost` naming that peer, and a peer that hangs
without exiting is caught by the groups' timeout (``trainer.peer_timeout_s``).
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlcli.dist import new_group

_ALIGN = 64  # byte alignment of every tensor inside a bucket's flat buffer (dtype views need it)


@dataclass
class Placement:
    """Global ranks of each role. Train rank 0 (``train[0]``) coordinates the run."""

    train: list[int]
    rollout: list[int]

    @property
    def train0(self) -> int:
        return self.train[0]

    def role(self, rank: int) -> str:
        if rank in self.train:
            return "train"
        if rank in self.rollout:
            return "rollout"
        raise ValueError(f"rank {rank} has no role (train ranks {self.train}, rollout ranks {self.rollout})")

    def as_dict(self) -> dict[str, list[int]]:
        return {"train": list(self.train), "rollout": list(self.rollout)}


@dataclass
class Channels:
    """The process groups of a disaggregated run (placeholders on ranks that are not members)."""

    placement: Placement
    train: Any
    command: Any
    reply: Any
    weights: Any

    @classmethod
    def create(cls, placement: Placement, device: torch.device | str, timeout_s: float) -> "Channels":
        """Collective over the whole job: every rank calls it with the same placement."""
        link = [placement.train0] + placement.rollout
        # Waits on these groups are for peers doing real work (a training step, a rollout batch).
        timeout = datetime.timedelta(seconds=timeout_s)
        train = new_group(placement.train, device, timeout=timeout)
        command = new_group(link, device, cpu_only=True, timeout=timeout)
        reply = new_group(link, device, cpu_only=True, timeout=timeout)
        weights = new_group(link, device, timeout=timeout)
        return cls(placement, train, command, reply, weights)


# ------------------------------------------------------------------------------ objects
class PeerLost(RuntimeError):
    """A message could not be exchanged: the peer failed, was killed, or did not answer in time."""


class RemoteFailure(RuntimeError):
    """The peer reported that it failed (a :class:`RemoteError` arrived instead of a message)."""


@dataclass
class RemoteError:
    """Sent in place of an answer (or a command) by a rank that is failing, so that its peer stops
    with the root cause instead of a lost connection."""

    rank: int
    role: str
    error: str
    traceback: str

    def raise_(self) -> None:
        raise RemoteFailure(f"{self.role} rank {self.rank} failed: {self.error}\n"
                           f"--- its traceback ---\n{self.traceback.rstrip()}")


def _lost(exc: BaseException, what: str, peer: int) -> PeerLost:
    me = dist.get_rank()
    who = f"rank {peer}" if peer != me else "a peer"
    return PeerLost(f"rank {me} lost {who} while {what}: it failed, was killed or hung; its own error is "
                    f"the one to read ({type(exc).__name__}: {exc})")


def send(obj: Any, dst: int, group, *, timeout_s: float | None = None) -> None:
    """Send a picklable object to global rank ``dst``. Blocks until the peer takes it (at most
    ``timeout_s`` when given, then :class:`PeerLost`)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.long)
    try:
        if timeout_s is None:
            dist.send(size, dst=dst, group=group)
            dist.send(payload, dst=dst, group=group)
        else:
            for work in (dist.isend(size, dst=dst, group=group), dist.isend(payload, dst=dst, group=group)):
                work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise _lost(exc, "sending to it", dst) from exc


def recv(src: int, group) -> Any:
    """The next object from global rank ``src`` (blocks; a :class:`RemoteError` is raised here)."""
    size = torch.empty(1, dtype=torch.long)
    try:
        dist.recv(size, src=src, group=group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src=src, group=group)
    except RuntimeError as exc:
        raise _lost(exc, "waiting for its message", src) from exc
    obj = pickle.loads(payload.numpy().tobytes())
    if isinstance(obj, RemoteError):
        obj.raise_()
    return obj


def broadcast(obj: Any, src: int, group) -> Any:
    """``obj`` from global rank ``src`` on every member of ``group``."""
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    except RuntimeError as exc:
        raise _lost(exc, f"in a broadcast from rank {src}", src) from exc
    return box[0]


# ------------------------------------------------------------------------------ weights
@dataclass
class BucketManifest:
    """What one flat buffer of a weight update holds: ``names[i]`` is tensor ``index[i]``."""

    version: int
    names: list[str]
    index: list[int]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    nbytes: int


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], version: int) -> tuple[BucketManifest, torch.Tensor]:
    """A bucket as a manifest and one flat uint8 buffer (on the tensors' device). A tensor listed
    under several names (tied embeddings) is stored once; every tensor starts at a 64-byte offset."""
    seen: dict[int, int] = {}
    tensors: list[torch.Tensor] = []
    names, index = [], []
    for name, t in bucket:
        if id(t) not in seen:
            seen[id(t)] = len(tensors)
            tensors.append(t)
        names.append(name)
        index.append(seen[id(t)])
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    manifest = BucketManifest(version, names, index, [str(t.dtype).removeprefix("torch.") for t in tensors],
                              [tuple(t.shape) for t in tensors], offsets, off)
    flat = torch.zeros(off, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for t, o in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        flat[o:o + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return manifest, flat


def unpack_bucket(manifest: BucketManifest, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a packed bucket, as views into ``flat``."""
    tensors = []
    for dtype, shape, off in zip(manifest.dtypes, manifest.shapes, manifest.offsets):
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        tensors.append(flat[off:off + n].view(dt).reshape(shape))
    return [(name, tensors[i]) for name, i in zip(manifest.names, manifest.index)]


def _broadcast_tensor(t: torch.Tensor, src: int, group) -> None:
    try:
        dist.broadcast(t, src=src, group=group)
    except RuntimeError as exc:
        raise _lost(exc, "transferring weights", src) from exc


class WeightSender:
    """Train rank 0's end of a weight update: broadcast buckets on the ``weights`` group."""

    def __init__(self, group, src: int):
        self.group, self.src = group, src
        self.bytes = 0
        self.buckets = 0

    def send(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        manifest, flat = pack_bucket(bucket, version)
        broadcast(manifest, self.src, self.group)
        _broadcast_tensor(flat, self.src, self.group)
        self.bytes += flat.numel()
        self.buckets += 1

    def finish(self) -> None:
        """Tell the receivers the update is complete."""
        broadcast(None, self.src, self.group)


def receive_weights(group, src: int, device: torch.device) -> Iterator[tuple[list[tuple[str, torch.Tensor]], int]]:
    """A rollout rank's end: yields ``(bucket, version)`` until the sender's :meth:`WeightSender.finish`.

    Each bucket's tensors are views into one freshly received buffer on ``device``; at most one
    bucket is held at a time.
    """
    while True:
        manifest: BucketManifest | None = broadcast(None, src, group)
        if manifest is None:
            return
        flat = torch.empty(manifest.nbytes, dtype=torch.uint8, device=device)
        _broadcast_tensor(flat, src, group)
        yield unpack_bucket(manifest, flat), manifest.version
