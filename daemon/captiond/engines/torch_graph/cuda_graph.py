"""CUDA graphs of the single-token decode step, one per batch bucket, sharing one memory pool.

Owns capture (done once, from the engine's warmup) and replay. The captured function writes only
into the preallocated decode state and KV cache, so no graph output lives in the pool and any
bucket's graph can replay after any other. Runs on the engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from captiond.engines.torch_graph.model import step_attention

logger = logging.getLogger(__name__)

# Eager steps per bucket before capture: lets cuBLAS/attention pick kernels and allocate workspaces
# outside the graph, as PyTorch's capture guide asks.
_WARMUP_STEPS = 3


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `max_batch`, then `max_batch` itself."""
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch)
    return tuple(sizes)


def bucket_for(n_rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `n_rows`."""
    return next(b for b in buckets if b >= n_rows)


class StepGraphs:
    """`step(bucket)` captured per bucket; `run(bucket)` replays (or runs eagerly when disabled).

    `compiled`: each bucket's step goes through `torch.compile` (Inductor fuses the step's
    element-wise work into a few Triton kernels) before it is captured, so a replay launches
    fewer, fused kernels. Compilation happens in the capture's warm-up steps.
    """

    def __init__(
        self,
        step: Callable[[int], None],
        buckets: Sequence[int],
        enabled: bool,
        compiled: bool = False,
    ) -> None:
        self.buckets = tuple(buckets)
        self.enabled = enabled
        self.compiled = compiled
        # One compiled function per bucket: each has static shapes and its own guard cache.
        self._steps: dict[int, Callable[[], None]] = {
            b: torch.compile(partial(step, b), fullgraph=True, dynamic=False)
            if compiled
            else partial(step, b)
            for b in self.buckets
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def step(self, bucket: int) -> None:
        """One eager step of `bucket` (what the capture records), with the step's attention
        kernels (`model.step_attention`, set around a compiled step, not inside it)."""
        with step_attention():
            self._steps[bucket]()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self) -> None:
        """Warm each bucket up on a side stream, then capture largest first into one pool."""
        if not self.enabled or self.graphs:
            return
        started_s = time.perf_counter()
        torch.cuda.synchronize()
        reserved_before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(_WARMUP_STEPS):
                    self.step(bucket)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then fit in blocks the pool already holds.
        for bucket in sorted(self.buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured decode-step CUDA graphs for buckets %s in %.2f s (+%.1f MiB reserved)",
            ",".join(map(str, self.buckets)),
            time.perf_counter() - started_s,
            (torch.cuda.memory_reserved() - reserved_before) / 2**20,
        )

    def run(self, bucket: int) -> None:
        graph = self.graphs.get(bucket)
        if graph is None:
            self.step(bucket)
        else:
            graph.replay()

    def reset(self) -> None:
        """Drop the graphs (and with them their pool)."""
        self.graphs.clear()
