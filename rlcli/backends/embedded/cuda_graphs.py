"""CUDA-graph replay of the embedded engine's decode forward, one graph per bucketed shape."""

from __future__ import annotations

import torch

from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.model import LlamaFamilyModel


class CudaGraphDecoder:
    """Replays CUDA graphs of :meth:`LlamaFamilyModel.decode`, one per ``(rows, key_len)`` shape.

    A decode step of a small model is dominated by the CPU cost of launching several hundred
    kernels; replaying a captured graph launches them all at once. Graphs are captured lazily,
    the first time a shape is seen (the engine rounds shapes to buckets, so there are few), and
    share one memory pool, static input buffers and one static logits buffer, so each extra
    graph costs little memory. Weights updated in place are seen by the graphs; anything that
    reallocates weights or the KV cache (sleep / wake_up) must call :meth:`reset`.
    """

    def __init__(self, model: LlamaFamilyModel, cache: KVCache, max_rows: int,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.model, self.cache = model, cache
        self.prefix = prefix  # per-row prefix rows and lengths ([max_rows], fixed addresses): read at replay
        dev = model.device
        with torch.inference_mode():  # like every tensor the engine steps see (compiled code guards on the kind)
            self._tokens = torch.zeros(max_rows, dtype=torch.int64, device=dev)
            self._positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
            self._logits = torch.zeros(max_rows, model.vocab_size, dtype=model.dtype, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0  # graphs captured so far (a recapture after a reset counts again)
        # one side stream for every warm-up and capture: libraries keep per-stream workspaces
        self._stream = torch.cuda.Stream(dev)

    @staticmethod
    def supported(model: LlamaFamilyModel) -> bool:
        """False for RoPE variants whose update reads tensor values on the host (not capturable)."""
        rope_type = str(getattr(model.rotary, "rope_type", "default"))
        return "dynamic" not in rope_type and "longrope" not in rope_type

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph (their recorded addresses are stale after reallocation)."""
        self._graphs.clear()
        self._pool = None

    def _forward(self, rows: int, key_len: int) -> None:
        prefix = None if self.prefix is None else (self.prefix[0][:rows], self.prefix[1][:rows])
        self.model.decode(self._tokens[:rows], self._positions[:rows], self.cache, key_len, allow_cudnn=True,
                          out=self._logits[:rows], prefix=prefix)

    def _capture(self, rows: int, key_len: int) -> torch.cuda.CUDAGraph:
        # Warm up eagerly on a side stream (library handles, kernel plans), then capture. Both
        # run the forward with every position at key_len - 1, which is at or past the end of
        # every active row's cache, so nothing valid is overwritten.
        self._tokens[:rows].zero_()
        self._positions[:rows].fill_(key_len - 1)
        stream = self._stream
        current = torch.cuda.current_stream(self.model.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # also where torch.compile (re)compiles: never inside a capture
            self._forward(rows, key_len)
        current.wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._forward(rows, key_len)
        self._graphs[(rows, key_len)] = graph
        self.captures += 1
        return graph

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Same as ``model.decode(tokens, positions, cache, key_len)``; the result is a view of
        a static buffer, valid until the next call."""
        rows = tokens.shape[0]
        graph = self._graphs.get((rows, key_len))
        if graph is None:
            graph = self._capture(rows, key_len)
        self._tokens[:rows].copy_(tokens)
        self._positions[:rows].copy_(positions)
        graph.replay()
        return self._logits[:rows]
