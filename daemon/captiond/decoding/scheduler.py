"""InferenceScheduler: every session's decode requests, batched through one engine thread.

`Decoder` is what the daemon decodes through: this scheduler when the engine is in the same
process, or `remote.EngineClient` in a worker process (workers/pool.py).

Two sides. The asyncio side (`submit`, event-loop thread) queues a request with a future and
awaits it. The engine thread (the only thread that touches the engine, its models and any
CUDA context once it runs, but for a CPU speaker model's calls on the speaker thread below; a
model every stream needs is loaded in `start`, before it) takes turn requests first, then
finals, then partials, oldest first, up to `max_batch`, waiting at most `max_wait_ms` for a
batch to fill (woken by the first request and by the one that fills it); it answers the turn
requests with the end-of-turn model, then decodes the rest, and resolves the futures through
`call_soon_threadsafe`. It records batch sizes, queue wait and engine time in the daemon's
metrics.

The speaker windows a batch's diarized requests ask for are embedded in one call of the
speaker-embedding model: on the speaker thread, beside the batch's decodes, when the model runs
on the CPU (`Embedder.concurrent`: the decoder leaves cores idle, and a final's embeddings then
add nothing to its wait for the decode), else on the engine thread after them. Either way the
engine thread answers the batch once both are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Generic, Protocol, TypeVar

from captiond.config import SchedulerConfig
from captiond.engines.base import (
    DecodeKind,
    Embedder,
    Embeddings,
    Engine,
    EngineInfo,
    EngineRequest,
    EngineResult,
    Submit,
    TurnModel,
    judge_turns,
    speaker_vectors,
    with_speakers,
)
from captiond.errors import EngineFailedError
from captiond.ops.metrics import Metrics

log = logging.getLogger(__name__)
_M = TypeVar("_M")

# `/healthz` answers 503 when the engine thread's heartbeat (each batch, and once a second
# while idle) is older than this: longer than any batch takes, shorter than a monitor waits.
HEALTHY_WITHIN_S = 30.0
# How long a stop waits for the engine thread's batch in progress. A wedged engine (a GPU
# hang, a stuck driver call) never finishes it; the thread is a daemon thread, so the process
# exits without it rather than hang until systemd's TimeoutStopSec kills it.
_STOP_WAIT_S = 10.0

# How long the event-loop thread may keep the GIL once the engine thread asks for it (Python's
# default is 5 ms). torch releases the GIL around every operator and every CUDA graph replay,
# so the engine thread asks for it again after each one; with the other thread busy it waited
# up to the whole interval every time: a torch_graph batch on the CPU took 4.4 s instead of
# 1.3 s beside a thread running Python 90 % of the time, 2.5 s with 0.5 ms.
ENGINE_SWITCH_INTERVAL_S = 0.0005


@dataclass(order=True, slots=True)
class _Item:
    priority: tuple[int, int]
    request: EngineRequest = field(compare=False)
    future: asyncio.Future[EngineResult] = field(compare=False)
    loop: asyncio.AbstractEventLoop = field(compare=False)
    queued_monotonic: float = field(compare=False, default_factory=time.monotonic)


@dataclass(slots=True)
class SchedulerStats:
    requests: int = 0
    heartbeat_monotonic: float = field(default_factory=time.monotonic)


class Decoder(Protocol):
    """The engine as the daemon sees it (event-loop thread): its facts, its heartbeat, and a
    `Submit` per stream. `key` names the stream so that a remote engine can keep its audio."""

    @property
    def engine_info(self) -> EngineInfo: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def stats(self) -> SchedulerStats: ...

    def stream(self, key: str) -> Submit: ...

    def forget(self, key: str) -> None:
        """The stream is over: whatever is kept for it can go."""


class InferenceScheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        metrics: Metrics | None = None,
        *,
        embedder: Callable[[], Embedder] | None = None,
        load_embedder_at_start: bool = False,
        turn_model: Callable[[], TurnModel] | None = None,
        load_turn_model_at_start: bool = False,
    ) -> None:
        self._engine = engine
        self.engine_info = dataclasses.replace(
            EngineInfo.of(engine),
            diarizes=embedder is not None,
            judges_turns=turn_model is not None,
        )
        # The models beside the engine (engines.speaker_embedder, engines.turn_model), loaded on
        # this engine thread when the first request that needs one comes; None: that model
        # cannot run here. A daemon whose every stream needs one ([stream] diarize,
        # [vad] end_of_turn = "model") loads it in start() instead, before it serves: loading
        # CAM++ (torch's import, the weights, the first call) took 2.3 s on the 2-core VM, and
        # every stream's decodes would wait behind it.
        self._embedder = _LazyModel[Embedder]("the speaker-embedding model", embedder)
        # Where a concurrent embedder runs (its thread starts with the first embedding).
        self._speaker_thread = ThreadPoolExecutor(1, thread_name_prefix="captiond-speakers")
        self._turn_model = _LazyModel[TurnModel]("the end-of-turn model", turn_model)
        self._load_at_start = [
            model
            for model, at_start in (
                (self._embedder, load_embedder_at_start),
                (self._turn_model, load_turn_model_at_start),
            )
            if at_start
        ]
        self.metrics = metrics or Metrics()
        self._max_batch = max(1, config.max_batch or engine.max_batch)
        self._max_wait_s = config.max_wait_ms / 1000
        self._pending: list[_Item] = []
        self._cond = threading.Condition()
        self._seq = count()
        self._stopping = False
        self.stats = SchedulerStats()
        self._thread = threading.Thread(target=self._run, name="captiond-engine", daemon=True)

    @property
    def engine(self) -> Engine:
        return self._engine

    def start(self) -> None:
        """Load the models every stream needs, start the engine thread, and
        shorten the interpreter's switch interval for the process (ENGINE_SWITCH_INTERVAL_S)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        for model in self._load_at_start:
            model.get()  # before the thread takes its first batch
        self._thread.start()

    def stream(self, key: str) -> Submit:
        """In this process the request carries its audio; it names its stream, so that the
        engine can keep the stream's audio between decodes (`EngineRequest.stream`)."""

        async def submit(request: EngineRequest) -> EngineResult:
            return await self.submit(dataclasses.replace(request, stream=key))

        return submit

    def forget(self, key: str) -> None:
        """Nothing is kept per stream here (an engine that keeps audio lets the least recently
        decoded stream's go first)."""

    def stop(self) -> None:
        """Finish the batch in progress, fail what is still queued, and join the thread (at
        most `_STOP_WAIT_S`: an engine that does not come back is left behind)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(_STOP_WAIT_S)
        self._speaker_thread.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            log.error(
                "the engine did not finish its batch in %.0f s: stopping without it", _STOP_WAIT_S
            )

    async def submit(self, request: EngineRequest) -> EngineResult:
        """Queue one request and wait for its result (EngineFailedError if the engine raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EngineResult] = loop.create_future()
        # Turn requests first (a verdict makes a final due), then finals, then partials.
        rank = {DecodeKind.TURN: -1, DecodeKind.FINAL: 0, DecodeKind.PARTIAL: 1}[request.kind]
        with self._cond:
            if self._stopping:
                raise EngineFailedError("the engine is shutting down")
            self._pending.append(_Item((rank, next(self._seq)), request, future, loop))
            # Wake the engine thread only for the first request (it waits for one) or a full
            # batch (it waits for the batch to fill until max_wait_ms). A wake-up per request
            # handed the GIL back and forth with this thread: at 2,000 requests a second, 30x
            # the involuntary context switches and 10 % more CPU.
            if len(self._pending) in (1, self._max_batch):
                self._cond.notify()
        return await future

    # -- engine thread -----------------------------------------------------------------------

    def _take_batch(self) -> list[_Item] | None:
        with self._cond:
            while not self._pending and not self._stopping:
                # Wake up now and then so the heartbeat shows the thread is alive when idle.
                self._cond.wait(timeout=1.0)
                self.stats.heartbeat_monotonic = time.monotonic()
            if self._stopping:
                # What is still queued is answered now, not decoded: the drain is over.
                dropped, self._pending = self._pending, []
                error = EngineFailedError("the engine is shutting down")
                for item in dropped:
                    _answer(item, _set_exception, error)
                return None
            deadline = time.monotonic() + self._max_wait_s
            while len(self._pending) < self._max_batch and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            self._pending.sort()
            batch, self._pending = (
                self._pending[: self._max_batch],
                self._pending[self._max_batch :],
            )
            return batch

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            live = [item for item in batch if not item.future.cancelled()]
            if turns := [item for item in live if item.request.kind is DecodeKind.TURN]:
                self._answer_turns(turns)
                live = [item for item in live if item.request.kind is not DecodeKind.TURN]
                self.stats.heartbeat_monotonic = time.monotonic()
            if not live:
                continue
            started = time.monotonic()
            self._observe(live, started)
            speakers = self._embed_beside(live)
            try:
                results = self._engine.transcribe_batch([item.request for item in live])
            except Exception as exc:  # the engine's failure fails a request, not the daemon
                if len(live) == 1:
                    _fail(live[0], exc)
                else:
                    # One request the engine cannot take (a language a resumed session's
                    # model lacks) must not fail the other streams of its batch.
                    log.exception("engine failed on a batch of %d: each again alone", len(live))
                    embeddings = self._embeddings(live, speakers)
                    for item, vectors in zip(live, embeddings, strict=True):
                        self._run_alone(item, vectors)
            else:
                results = with_speakers(results, self._embeddings(live, speakers))
                for item, result in zip(live, results, strict=True):
                    _answer(item, _set_result, result)
            self.stats.requests += len(live)
            self.stats.heartbeat_monotonic = time.monotonic()
            self.metrics.engine_seconds.observe(self.stats.heartbeat_monotonic - started)
            for phase, seconds in self._engine.phases.drain().items():
                self.metrics.engine_phase_seconds.labels(phase=phase).inc(seconds)

    def _run_alone(self, item: _Item, embeddings: Embeddings) -> None:
        try:
            (result,) = self._engine.transcribe_batch([item.request])
        except Exception as exc:
            _fail(item, exc)
        else:
            (result,) = with_speakers([result], [embeddings])
            _answer(item, _set_result, result)

    def _embed_beside(self, batch: list[_Item]) -> Future[list[Embeddings]] | None:
        """Start the batch's speaker embeddings on the speaker thread, when its requests ask
        for some and the model runs beside the decodes (`Embedder.concurrent`); None: they
        are embedded after the decodes, if at all (`_embeddings`)."""
        if not any(item.request.speaker_windows for item in batch):
            return None
        embedder = self._embedder.get()
        if embedder is None or not embedder.concurrent:
            return None
        requests = [item.request for item in batch]
        return self._speaker_thread.submit(self._embed, embedder, requests)

    def _embeddings(
        self, batch: list[_Item], beside: Future[list[Embeddings]] | None
    ) -> list[Embeddings]:
        """The speaker embeddings of each request of the batch: those the speaker thread
        computed (waited for), or computed now. A model that cannot load or fails leaves them
        empty: their finals then say no speaker, and their text is not lost."""
        none: list[Embeddings] = [() for _ in batch]
        try:
            if beside is not None:
                return beside.result()
            asked = any(item.request.speaker_windows for item in batch)
            if asked and (embedder := self._embedder.get()) is not None:
                return self._embed(embedder, [item.request for item in batch])
        except Exception:
            log.exception("speaker embeddings failed: these finals go without speakers")
        return none

    def _embed(self, embedder: Embedder, requests: list[EngineRequest]) -> list[Embeddings]:
        """The requests' embeddings, timed (engine thread, or the speaker thread)."""
        started = time.monotonic()
        try:
            return speaker_vectors(embedder, requests)
        finally:
            self.metrics.diarization_seconds.observe(time.monotonic() - started)

    def _answer_turns(self, turns: list[_Item]) -> None:
        """Answer the batch's turn requests (`DecodeKind.TURN`) before its decodes, in one
        call of the end-of-turn model: a verdict ends an utterance now, and the final it makes
        due is then decoded sooner. A model that cannot load or fails answers no verdict:
        those turns wait for the longest pause (streaming/vad.py)."""
        started = time.monotonic()
        results = [EngineResult(text="") for _ in turns]
        if (turn_model := self._turn_model.get()) is not None:
            try:
                results = judge_turns(turn_model, [item.request for item in turns])
            except Exception:
                log.exception("the end-of-turn model failed: these turns wait for silence")
            self.metrics.turn_seconds.observe(time.monotonic() - started)
        for item, result in zip(turns, results, strict=True):
            _answer(item, _set_result, result)

    def _observe(self, batch: list[_Item], started: float) -> None:
        self.metrics.batch_size.observe(len(batch))
        for item in batch:
            self.metrics.queue_wait_seconds.observe(started - item.queued_monotonic)
            self.metrics.decode_requests.labels(kind=item.request.kind.value).inc()


class _LazyModel(Generic[_M]):
    """A model loaded on its first use (engine thread), tried once: one that cannot load is
    logged, and the finals that ask for it go without its answer."""

    def __init__(self, name: str, load: Callable[[], _M] | None) -> None:
        self._name = name
        self._load = load
        self._model: _M | None = None

    def get(self) -> _M | None:
        if self._model is None:
            load, self._load = self._load, None
            if load is None:
                return None
            try:
                self._model = load()
            except Exception:
                log.exception("%s did not load", self._name)
        return self._model


def _answer(
    item: _Item, setter: Callable[[asyncio.Future[EngineResult], Any], None], value: Any
) -> None:
    """Hand a batch's answer to the loop that asked (engine thread). A loop already closed (a
    stop that left a wedged batch behind) waits for nothing any more."""
    with contextlib.suppress(RuntimeError):
        item.loop.call_soon_threadsafe(setter, item.future, value)


def _fail(item: _Item, exc: Exception) -> None:
    """Answer `item` with the engine's failure (engine thread, handling `exc`)."""
    log.exception("engine failed on a request of stream %r", item.request.stream)
    _answer(
        item, _set_exception, EngineFailedError(f"the engine failed: {type(exc).__name__}: {exc}")
    )


def _set_result(future: asyncio.Future[EngineResult], result: EngineResult) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[EngineResult], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
