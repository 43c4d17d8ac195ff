"""Runs the LLMEngine loop in its own thread and gives asyncio code a small, thread-safe API.

The engine is not thread-safe, so only the engine thread ever touches it: the event loop hands work over
through a queue (add, abort, call) and gets results back via loop.call_soon_threadsafe. Model steps thus
never block the event loop, and requests from every connection join the same continuous batch."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from stateserve.engine.llm_engine import LLMEngine
from stateserve.entrypoints.streams import EngineDead, EngineOverloaded, GroupUpdate, RequestStream, SeqUpdate
from stateserve.entrypoints.submission import add_all
from stateserve.sampling_params import SamplingParams

logger = logging.getLogger("stateserve.server")
_IDLE_WAIT_S = 0.5  # how long an idle engine thread sleeps on the queue before re-checking
# The engine thread releases the GIL inside every kernel and must win it back when the kernel returns; with
# Python's default 5 ms switch interval it can wait that long behind the event loop's work on every op of a step.
# 0.5 ms measured +10-30% output tokens/s on the serving benchmark (bench/serve.py); 0.1 ms was worse again.
_GIL_SWITCH_INTERVAL_S = 0.0005


def build_off_main_thread(factory: Callable[[], Any]) -> Any:
    """Run `factory` (the engine's construction: loading, warm-up, cache profiling) on a short-lived thread.

    Why: OpenMP (libgomp) keeps a team of worker threads for every thread that ran a parallel region, and once it
    manages more threads than there are cores it stops spinning at barriers and sleeps on every one. Building the
    engine on the main thread would leave the main thread's team behind while the engine thread creates its own:
    on 2 cores every op of every step then paid a futex sleep and wake (Mamba2-30m, 16 sequences: 950 instead of
    1600 tokens/s). A builder thread's team goes away with the thread."""
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            box["result"] = factory()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=build, name="stateserve-build", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass
class _Group:
    stream: RequestStream
    prompt_index: int
    sent: list[int]  # per sequence: output tokens already reported
    done: list[bool]  # per sequence: finish already reported


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = engine.max_prompt_len  # an encoder's real limit for an embedding model
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._groups: dict[str, _Group] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.error: BaseException | None = None
        self.final_state: dict[str, Any] | None = None  # set by the engine thread when it stops
        self.snapshot: dict[str, int] = self._take_snapshot()
        self._switch_interval = sys.getswitchinterval()

    # ---- event-loop side -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._switch_interval = sys.getswitchinterval()  # a process-wide setting: restored when the engine stops
        sys.setswitchinterval(min(self._switch_interval, _GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="stateserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _dead_error(self) -> EngineDead:
        if isinstance(self.error, EngineDead):
            return self.error
        return EngineDead(f"the engine stopped: {self.error!r}" if self.error else "the engine is not running")

    def _check_alive(self) -> None:
        if not self.is_running:
            raise self._dead_error()

    async def submit(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                     stream_text: bool = False) -> RequestStream:
        """Add all prompts (or none: a bad prompt raises ValueError, a full queue EngineOverloaded). stream_text:
        each update carries the text its tokens added (SeqUpdate.new_text)."""
        return await self._submit("add", len(prompts), prompts, params, stream_text)

    async def submit_embed(self, inputs: list[str | list[int]], keep_last: int | None) -> RequestStream:
        """Queue one embedding request per input (text or token ids), truncated to its last `keep_last` tokens; all
        or none (a bad input raises ValueError naming it, a full queue EngineOverloaded). Each input's update
        carries its vector once it ran."""
        return await self._submit("embed", len(inputs), inputs, keep_last)

    async def _submit(self, kind: str, count: int, *payload: Any) -> RequestStream:
        self._check_alive()
        group_ids = [f"{self._prefix}-{next(self._ids)}" for _ in range(count)]
        stream = RequestStream(self.abort, group_ids)
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._send(kind, (group_ids, *payload, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(group_ids)  # the add may still land after we stopped waiting
            raise
        return stream

    def owns(self, group_id: str) -> bool:
        """Whether `group_id` is one of this engine's (data parallelism routes aborts by it)."""
        return group_id.startswith(self._prefix + "-")

    def abort(self, group_ids: list[str]) -> None:
        """Thread-safe and non-blocking."""
        self._send("abort", list(group_ids))

    def abort_all(self) -> None:
        self._send("abort_all", None)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (fn, fut))
        return await asyncio.wrap_future(fut)

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float = 30.0) -> Any:
        """Like `call`, from any thread but the event loop's (tests, tools)."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (fn, fut))
        return fut.result(timeout)

    async def shutdown(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """Abort what is left, free the caches, shut the engine down; returns the final cache state."""
        if self._thread is None:
            return None
        self._send("stop", None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        return self.final_state

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if self._handle_commands(block=not engine.has_unfinished()):
                    break
                if engine.has_unfinished():
                    finished = engine.step()
                    # the snapshot (the /metrics gauges, the data-parallel router's load) before the outputs go
                    # out: a client that got its last token and reads /metrics must not still see its request
                    self.snapshot = self._take_snapshot()
                    self._publish(list(dict.fromkeys(engine.last_updated + finished)))
                else:
                    self.snapshot = self._take_snapshot()
        except BaseException as e:  # a step raised: fail everyone clearly rather than hang
            logger.exception("the engine thread stopped on an error")
            self.error = e
            self._fail_all(self._dead_error())
        finally:
            self._close()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; True when asked to stop."""
        try:
            first = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        batch = [first]
        while True:
            try:
                batch.append(self._commands.get_nowait())
            except queue.Empty:
                break
        stop = False
        for kind, payload in batch:
            if kind == "stop":
                stop = True
            else:  # work queued beside a stop still runs; _close then aborts it cleanly
                getattr(self, f"_do_{kind}")(payload)
        return stop

    def _do_add(self, payload: tuple) -> None:
        group_ids, prompts, params, stream_text, stream, accepted = payload
        engine = self.engine

        def prepare() -> list:  # one share of the engine's admission for the whole submission
            return [engine.prepare_request(gid, ids, params, prompt=text, fairness_key=group_ids[0],
                                           stream_text=stream_text)
                    for gid, (text, ids) in zip(group_ids, prompts)]
        self._add(prepare, stream, accepted)

    def _do_embed(self, payload: tuple) -> None:
        group_ids, inputs, keep_last, stream, accepted = payload
        engine = self.engine

        def prepare() -> list:
            prepared = []
            for i, (gid, item) in enumerate(zip(group_ids, inputs)):
                prompt = item if isinstance(item, str) else {"prompt_token_ids": item}
                try:
                    prepared.append(engine.prepare_embed(gid, prompt, keep_last, fairness_key=group_ids[0]))
                except ValueError as e:
                    raise ValueError(f"input[{i}]: {e}") from None
            return prepared
        self._add(prepare, stream, accepted)

    def _add(self, prepare: Callable[[], list], stream: RequestStream, accepted: asyncio.Future) -> None:
        """Prepare a submission whole (a bad prompt is a 400 even when the queue is full), check the queue's room,
        then queue all of it or none."""
        engine = self.engine
        try:
            prepared = prepare()
            # Sequences that will wait for a batch slot; ones that free slots take at the next step do not.
            sched = engine.scheduler
            free_slots = max(0, sched.max_num_seqs - len(sched.running))
            waiting = max(0, len(sched.waiting) - free_slots)
            new_waiting = max(0, len(sched.waiting) + sum(map(len, prepared)) - free_slots)
            if self.max_waiting_requests is not None and new_waiting > self.max_waiting_requests:
                raise EngineOverloaded(f"the waiting queue is full ({waiting} waiting, limit "
                                       f"{self.max_waiting_requests}); retry later")
            add_all(engine, prepared)
        except Exception as e:  # a request that cannot be added fails alone; the engine keeps serving
            self._post(_resolve, accepted, e)
            return
        for i, children in enumerate(prepared):
            n = len(children)
            self._groups[children[0].group_id] = _Group(stream, i, [0] * n, [False] * n)
        self._post(_resolve, accepted, None)

    def _do_abort(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            if gid in self.engine.groups:
                self.engine.abort_request(gid)
        self._publish([g for g in group_ids if g in self._groups])

    def _do_abort_all(self, _: Any) -> None:
        self._do_abort(list(self._groups))

    def _do_call(self, payload: tuple) -> None:
        fn, fut = payload
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except BaseException as e:
            fut.set_exception(e)

    def _publish(self, group_ids: list[str]) -> None:
        """Send each listed group's new tokens to its stream; pop finished groups out of the engine."""
        now = time.perf_counter()
        out: list[tuple[RequestStream, GroupUpdate]] = []
        for gid in group_ids:
            group = self._groups.get(gid)
            reqs = self.engine.groups.get(gid)
            if group is None or reqs is None:
                continue
            seqs = []
            for i, req in enumerate(reqs):
                k = group.sent[i]
                if len(req.output_token_ids) == k and (group.done[i] or not req.is_finished):
                    continue
                upd = SeqUpdate(i, req.output_token_ids[k:],
                                None if req.logprobs is None else req.logprobs[k:])
                group.sent[i] = len(req.output_token_ids)
                if req.is_finished:
                    group.done[i] = True
                    upd.finish_reason, upd.stop_reason, upd.text = req.finish_reason, req.stop_reason, \
                        req.output_text
                    upd.error = req.error
                if req.detok is not None:  # the final text is authoritative: the deltas always add up to it
                    upd.new_text = req.detok.delta(req.output_text if req.is_finished else None)
                seqs.append(upd)
            finished = all(group.done)
            first = reqs[0]
            vector = first.embedding.numpy() if first.embedding is not None else None
            out.append((group.stream, GroupUpdate(group.prompt_index, seqs, finished, first.num_prompt_tokens,
                                                  first.num_cached_tokens, now, vector,
                                                  first.prompt_logprobs if finished else None)))
            if finished:
                self._drop(gid)
        if out:
            self._post(_deliver, out)

    def _drop(self, gid: str) -> None:
        self._groups.pop(gid, None)
        if gid in self.engine.groups:
            self.engine.abort_request(gid)
            self.engine.pop_output(gid)

    def _fail_all(self, exc: BaseException) -> None:
        streams = {id(g.stream): g.stream for g in self._groups.values()}
        for stream in streams.values():
            self._post(stream._put, exc)
        while True:  # answer queued work too, so no caller waits forever
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind in ("add", "embed"):
                self._post(_resolve, payload[-1], exc)
            elif kind == "call" and payload[1].set_running_or_notify_cancel():
                payload[1].set_exception(exc)

    def _close(self) -> None:
        """Last act of the engine thread: abort what is left, check the caches, release the engine."""
        state: dict[str, Any] = {"aborted": len(self._groups)}
        try:
            self._do_abort_all(None)
            self.engine.check_integrity()
            state["integrity_ok"] = True
            state["idle_and_full"] = self.engine.cache.is_idle_and_full()
        except Exception as e:
            state["integrity_ok"], state["error"] = False, repr(e)
        finally:
            if self.error is None:
                self.error = EngineDead("the engine has been shut down")
            self._fail_all(self._dead_error())
            self.final_state = state
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
            sys.setswitchinterval(self._switch_interval)
        logger.info("engine stopped: %s", state)

    def _take_snapshot(self) -> dict[str, int]:
        engine, cache = self.engine, self.engine.cache
        snap = dict(engine.stats)
        snap["running"] = len(engine.scheduler.running)
        snap["waiting"] = len(engine.scheduler.waiting)
        if cache.block_pool is not None:
            snap["kv_blocks_total"] = cache.block_pool.num_blocks
            snap["kv_blocks_used"] = cache.block_pool.num_blocks - cache.block_pool.num_free
        if cache.slot_pool is not None:
            snap["state_slots_total"] = cache.slot_pool.num_slots
            snap["state_slots_used"] = cache.slot_pool.num_slots - cache.slot_pool.num_free
        return snap


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():  # the waiter was cancelled
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _deliver(items: list[tuple[RequestStream, GroupUpdate]]) -> None:
    for stream, update in items:
        stream._put(update)
