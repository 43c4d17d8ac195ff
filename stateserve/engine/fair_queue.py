"""The scheduler's waiting queue, which admits fairly between *shares*.

A share is every sequence with the same `Request.fairness_key`: by default one request group (one prompt's n
samples); `LLM.generate` uses one key per call and a server may pass one per client submission, so a submission
of many prompts x n samples is one share. Which waiting sequence is admitted next:

1. a preempted sequence first (most recently preempted first), as before: it was running and is recomputed;
2. otherwise the oldest waiting sequence of the share with the fewest sequences running now, ties going to the
   share whose oldest waiting sequence arrived first.

With one share (or only n=1 requests, each its own share with nothing running while it waits) this is exactly
first-come first-served. A big share holds at most its fair part of the batch slots once others wait: a new small
request is admitted at the next free slot instead of after the big one's last sequence. Picking is O(log shares)
through a heap of (running count, head arrival, key) entries, made stale by any change and skipped lazily."""
from __future__ import annotations

import heapq
from collections import Counter, deque
from typing import Iterator

from stateserve.core.request import Request


class FairWaitingQueue:
    def __init__(self) -> None:
        self._preempted: deque[Request] = deque()
        self._shares: dict[str, deque[Request]] = {}  # key -> its waiting sequences, oldest first
        self._running: Counter[str] = Counter()  # key -> its sequences running now
        self._heap: list[tuple[int, int, str]] = []  # (running, arrival of the share's head, key), maybe stale
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting sequence: preempted ones first, then each share's in arrival order."""
        yield from self._preempted
        for q in self._shares.values():
            yield from q

    def num_running(self, key: str) -> int:
        return self._running[key]

    # ---- changes --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """A new sequence, behind the others of its share."""
        q = self._shares.setdefault(req.fairness_key, deque())
        q.append(req)
        self._len += 1
        if len(q) == 1:
            self._push(req.fairness_key)

    def add_preempted(self, req: Request) -> None:
        """A running sequence was preempted: it waits again, ahead of everything else."""
        self._preempted.appendleft(req)
        self._len += 1
        self.stopped(req)

    def started(self, req: Request) -> None:
        """`req` (as returned by `peek`) is admitted: take it out and count it as running."""
        if self._preempted and self._preempted[0] is req:
            self._preempted.popleft()
        else:
            q = self._shares[req.fairness_key]
            if q[0] is not req:
                raise RuntimeError(f"admitted {req.request_id}, which is not the next waiting sequence")
            q.popleft()
            if not q:
                del self._shares[req.fairness_key]
        self._len -= 1
        self._running[req.fairness_key] += 1
        self._push(req.fairness_key)

    def stopped(self, req: Request) -> None:
        """A running sequence finished or was preempted."""
        key = req.fairness_key
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]
        self._push(key)

    def remove(self, req: Request) -> bool:
        """Take a waiting sequence out (aborted or finished while waiting); False when it is not here."""
        if req in self._preempted:
            self._preempted.remove(req)
        else:
            q = self._shares.get(req.fairness_key)
            if q is None or req not in q:
                return False
            was_head = q[0] is req
            q.remove(req)
            if not q:
                del self._shares[req.fairness_key]
            elif was_head:
                self._push(req.fairness_key)
        self._len -= 1
        return True

    # ---- the policy -----------------------------------------------------------------------------
    def peek(self) -> Request | None:
        """The sequence to admit next (see the module doc), without taking it out."""
        if self._preempted:
            return self._preempted[0]
        heap = self._heap
        while heap:
            running, arrival, key = heap[0]
            q = self._shares.get(key)
            if q and q[0].arrival_index == arrival and self._running[key] == running:
                return q[0]
            heapq.heappop(heap)  # stale: the share changed since this entry was pushed
        return None

    def _push(self, key: str) -> None:
        q = self._shares.get(key)
        if not q:
            return
        heapq.heappush(self._heap, (self._running[key], q[0].arrival_index, key))
        if len(self._heap) > 4 * len(self._shares) + 64:  # drop stale entries now and then
            self._heap = [(self._running[k], s[0].arrival_index, k) for k, s in self._shares.items()]
            heapq.heapify(self._heap)
