"""A tensor-parallel group on torch.distributed: gloo on CPUs, over a TCPStore rendezvous.

The group is made from `ProcessGroupGloo` directly rather than through `init_process_group`, so it is no
process-wide default: several engines (tests build many) can each own a group in one process and drop it at
shutdown. Rank 0 is the engine's process and hosts the store; the other ranks are worker processes
(distributed/worker.py) on this host or on others (`--nnodes`, `--node-rank`).

Collectives used: all_reduce (one per row-parallel product), broadcast of each step's message from rank 0
(`send_object` / `recv_object`: pickled into a fixed-size first buffer, a second broadcast only for larger
messages), and point-to-point send / recv of activations between pipeline stages."""
from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A step's message (inputs, positions, metadata, journal) fits in one broadcast of this size nearly always.
FIRST_MESSAGE_BYTES = 1 << 16
_LENGTH_BYTES = 8
# Ranks wait on each other for the next step as long as the engine is idle: a dead peer is found by its
# closed connection (gloo raises at once), not by this timeout.
IDLE_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: the store's host and port (rank 0 listens), and whether every rank is on this host
    (gloo then talks over loopback)."""
    host: str
    port: int
    world_size: int
    single_host: bool

    @classmethod
    def parse(cls, init_method: str, world_size: int, single_host: bool) -> "Rendezvous":
        """tcp://HOST:PORT, torch.distributed's spelling of a TCP rendezvous."""
        if not init_method.startswith("tcp://") or ":" not in init_method[6:]:
            raise ValueError(f"distributed_init_method must be tcp://HOST:PORT, got {init_method!r}")
        host, _, port = init_method[6:].rpartition(":")
        if not port.isdigit():
            raise ValueError(f"distributed_init_method must be tcp://HOST:PORT, got {init_method!r}")
        return cls(host.strip("[]"), int(port), world_size, single_host)


def joined_key(rank: int) -> str:
    """The store key a worker sets once it has reached the store."""
    return f"joined/{rank}"


def _gloo(store: Any, rank: int, size: int, device: Any) -> Any:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = IDLE_TIMEOUT
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, options)


class ParallelGroup:
    """This process's rank among `size` ranks, and the collectives they run together."""

    def __init__(self, rank: int, size: int, store: Any = None, pg: Any = None, device: Any = None) -> None:
        self.rank, self.size = rank, size
        self._store, self._pg, self._device = store, pg, device
        # time this rank spent in collectives (waiting on the others included), for benchmarks
        self.comm_seconds, self.num_collectives = 0.0, 0

    @classmethod
    def connect(cls, rendezvous: Rendezvous, rank: int, store: Any = None,
                connect_timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> "ParallelGroup":
        """Join the group (rank 0 passes the store it already listens on)."""
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, rank == 0,
                                  connect_timeout, wait_for_workers=False)
            store.set(joined_key(rank), "1")  # rank 0 waits for this while its workers start (driver.py)
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if rendezvous.single_host else \
            dist.ProcessGroupGloo.create_default_device()
        return cls(rank, rendezvous.world_size, store, _gloo(store, rank, rendezvous.world_size, device), device)

    def subgroup(self, ranks: list[int], name: str) -> "ParallelGroup":
        """The ranks `ranks` (this one among them) as a group of their own, ranked by their order there: a tensor-
        parallel group within one pipeline stage. Only its members call this, each once; `name` tells the
        subgroups apart in the store."""
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in the subgroup {ranks}")
        if len(ranks) == 1:
            return ParallelGroup(0, 1)
        store = dist.PrefixStore(f"{name}/", self._store)
        rank = ranks.index(self.rank)
        return ParallelGroup(rank, len(ranks), store, _gloo(store, rank, len(ranks), self._device), self._device)

    @property
    def is_open(self) -> bool:
        return self._pg is not None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a contiguous tensor); returns it."""
        if self.size > 1:
            start = time.perf_counter()
            self._pg.allreduce([tensor]).wait()
            self._count(start)
        return tensor

    def _count(self, start: float) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([out], [tensor.contiguous()]).wait()
        return out

    def send_object(self, obj: Any) -> None:
        """Rank 0: broadcast a picklable object to every other rank."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        first = torch.zeros(FIRST_MESSAGE_BYTES, dtype=torch.uint8)
        first[:_LENGTH_BYTES] = torch.tensor(list(len(data).to_bytes(_LENGTH_BYTES, "little")), dtype=torch.uint8)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        head = min(len(data), FIRST_MESSAGE_BYTES - _LENGTH_BYTES)
        first[_LENGTH_BYTES:_LENGTH_BYTES + head] = payload[:head]
        start = time.perf_counter()
        self._pg.broadcast(first, 0).wait()
        if head < len(data):
            self._pg.broadcast(payload[head:].clone(), 0).wait()
        self._count(start)

    def recv_object(self) -> Any:
        """Other ranks: the object rank 0 broadcast next."""
        first = torch.empty(FIRST_MESSAGE_BYTES, dtype=torch.uint8)
        self._pg.broadcast(first, 0).wait()
        length = int.from_bytes(bytes(first[:_LENGTH_BYTES].tolist()), "little")
        head = min(length, FIRST_MESSAGE_BYTES - _LENGTH_BYTES)
        data = first[_LENGTH_BYTES:_LENGTH_BYTES + head].numpy().tobytes()
        if head < length:
            rest = torch.empty(length - head, dtype=torch.uint8)
            self._pg.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        start = time.perf_counter()
        self._pg.send([tensor.contiguous()], dst, 0).wait()
        self._count(start)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        start = time.perf_counter()
        self._pg.recv([tensor], src, 0).wait()
        self._count(start)
        return tensor

    def close(self) -> None:
        self._pg = None
        self._store = None
