"""The Triton decode-attention kernel (``rlcli.backends.decode_attention``) against plain torch.

On CPU the kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before Triton
is first imported (Triton's own helpers such as ``tl.cdiv`` are decorated at import). Setting it
in this process would be too late when another module imported Triton first, and would leak into
the other test modules (under ``make test-gpu`` torch.compile's Triton kernels would run
interpreted). So the ``test_kernel_*`` tests run in a child pytest process started with
``TRITON_INTERPRET=1`` (:func:`test_kernels_in_interpreter_child_process`); in this process
they are skipped, unless it was itself started with ``TRITON_INTERPRET=1``. Shapes are tiny
because the interpreter executes every program in Python; ``block_n=16`` gives rows several key
blocks anyway. The ``gpu`` test checks the compiled kernel, also under CUDA-graph replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton; Linux only)")

from rlcli.backends.decode_attention import (  # noqa: E402
    DEFAULT_SM_COUNT,
    MAX_SPLITS,
    choose_num_splits,
    decode_attention,
    triton_decode_attention_available,
)

REPO = Path(__file__).resolve().parent.parent


IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not IN_INTERPRETER, reason="runs in a TRITON_INTERPRET=1 child process (test_kernels_in_interpreter_child_process)")


@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the kernels in the interpreter")
def test_kernels_in_interpreter_child_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", "test_kernel_",
           __file__]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout + r.stderr


def reference(q, k_cache, v_cache, positions, key_len, scale, window=None):
    """Float64 attention row by row over exactly the visible keys (nothing else is read, so junk
    elsewhere in the cache - NaN included - cannot leak in); zeros for a row that sees no key."""
    n, num_heads, hd = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros(n, num_heads, hd, dtype=torch.float64)
    for i, pos in enumerate(positions.tolist()):
        end = min(pos + 1, key_len)
        start = 0 if window is None else max(pos - window + 1, 0)
        if start >= end:
            continue
        k = k_cache[i, :, start:end].double().repeat_interleave(group, 0)  # [H, l, hd]
        v = v_cache[i, :, start:end].double().repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hld->hl", q[i].double(), k) * scale, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", p, v)
    return out


def make_inputs(n, kv_heads, group, hd, max_len, positions, dtype, key_len, window=None, extra_rows=2, seed=0):
    """q and a cache that is a strided view of a bigger buffer (keys and values interleaved in
    dim 1, ``extra_rows`` more rows than ``n``) with NaN at every position a row must not read."""
    g = torch.Generator().manual_seed(seed)
    rows = n + extra_rows
    buf = torch.randn(rows, 2, kv_heads, max_len, hd, generator=g).to(dtype)
    pos = torch.tensor(positions, dtype=torch.int64)
    j = torch.arange(max_len)
    visible = (j[None, :] <= pos[:, None]) & (j[None, :] < key_len)
    if window is not None:
        visible &= j[None, :] > pos[:, None] - window
    hidden = torch.ones(rows, max_len, dtype=torch.bool)
    hidden[:n] = ~visible
    buf.masked_fill_(hidden[:, None, None, :, None], float("nan"))
    q = torch.randn(n, kv_heads * group, hd, generator=g).to(dtype)
    return q, buf[:, 0], buf[:, 1], pos


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


def check(dtype, group, hd, positions, key_len, window=None, num_splits=None, block_n=16, kv_heads=2, max_len=48):
    n = len(positions)
    q, k, v, pos = make_inputs(n, kv_heads, group, hd, max_len, positions, dtype, key_len, window)
    assert not k.is_contiguous() and k.shape[0] > n
    scale = hd**-0.5
    out = decode_attention(q, k, v, pos, key_len, scale, window, num_splits=num_splits, block_n=block_n)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, pos, key_len, scale, window), **TOL[dtype])


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("hd", [64, 80])
@pytest.mark.parametrize("group", [1, 2, 7])
def test_kernel_fp32_matches_reference(group, hd, num_splits):
    # positions all different, one at 0; key_len beyond every position + 1; 3 splits of up to
    # 3 blocks of 16 keys leave some splits empty
    check(torch.float32, group, hd, [0, 21, 40, 9], key_len=45, num_splits=num_splits)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 7, 20, 100])
def test_kernel_sliding_window(window, num_splits):
    check(torch.float32, 2, 80, [0, 21, 40, 6], key_len=45, window=window, num_splits=num_splits)


@interpreted
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [2, 7])
def test_kernel_bf16_matches_reference(group, num_splits, window):
    check(torch.bfloat16, group, 80, [0, 21, 40], key_len=41, window=window, num_splits=num_splits)


@interpreted
def test_kernel_fp16_and_large_group():
    check(torch.float16, 16, 64, [5, 30], key_len=33, num_splits=2, kv_heads=1)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_default_knobs(dtype):
    """Default block size (32 keys for float32, 64 for bf16) and the split rule's own choice."""
    check(dtype, 7, 64, [3, 70, 129], key_len=140, num_splits=None, block_n=None, kv_heads=1, max_len=150)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_rows_past_key_len(num_splits):
    """Keys stop at key_len even past a row's position; a row whose window lies entirely past
    key_len sees nothing and gets zeros (SDPA would give NaN)."""
    positions, key_len, window = [30, 50, 12], 20, 25
    q, k, v, pos = make_inputs(3, 2, 2, 64, 64, positions, torch.float32, key_len, window)
    out = decode_attention(q, k, v, pos, key_len, 0.125, window, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out.double(), reference(q, k, v, pos, key_len, 0.125, window), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def check_prefix(dtype, positions, key_len, prefix_rows, prefix_lens, window=None, num_splits=None, seed=3):
    """Rows that read their first ``prefix_lens[i]`` keys and values from row ``prefix_rows[i]``
    (a row of the cache, possibly one past ``n``): the result is exactly the kernel's result on a
    cache where every row holds its own copy, and a row's own copy of the prefix is never read
    (NaN there)."""
    n, kvh, group, hd, max_len = len(positions), 2, 2, 64, 48
    q, k, v, pos = make_inputs(n, kvh, group, hd, max_len, positions, dtype, key_len, window, extra_rows=2, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for r in sorted(set(prefix_rows)):  # the shared prompts' keys and values, finite, in their rows
        length = max(l for pr, l in zip(prefix_rows, prefix_lens) if pr == r)
        k[r, :, :length] = torch.randn(kvh, length, hd, generator=g).to(dtype)
        v[r, :, :length] = torch.randn(kvh, length, hd, generator=g).to(dtype)
    k_copy, v_copy = k.clone(), v.clone()  # every row with its own copy
    for i, (r, length) in enumerate(zip(prefix_rows, prefix_lens)):
        k_copy[i, :, :length], v_copy[i, :, :length] = k[r, :, :length], v[r, :, :length]
        if r != i:  # the kernel must read the prefix row's copy, never this one
            k[i, :, :length] = float("nan")
            v[i, :, :length] = float("nan")
    rows = torch.tensor(prefix_rows, dtype=torch.int64)
    lens = torch.tensor(prefix_lens, dtype=torch.int32)
    kw = dict(num_splits=num_splits, block_n=16)
    out = decode_attention(q, k, v, pos, key_len, hd**-0.5, window, prefix_rows=rows, prefix_lens=lens, **kw)
    assert torch.equal(out, decode_attention(q, k_copy, v_copy, pos, key_len, hd**-0.5, window, **kw))
    torch.testing.assert_close(out.double(), reference(q, k_copy, v_copy, pos, key_len, hd**-0.5, window), **TOL[dtype])


@interpreted
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_prefix_rows(dtype, num_splits, window):
    # rows 0, 1 and 4 share row 4's prompt (lengths differ: a prefix may end inside a block of 16
    # keys); row 2 is its own prefix row; row 3 reads row 5, one of the cache's rows past n
    check_prefix(dtype, [0, 21, 40, 9, 30], 45, prefix_rows=[4, 4, 2, 5, 4], prefix_lens=[1, 20, 40, 10, 20],
                 window=window, num_splits=num_splits)


def sdpa_decode(q, k_cache, v_cache, positions, key_len, scale, window=None):
    """The engine's SDPA path (``attention: sdpa``), as ``LlamaFamilyModel._decode`` calls it."""
    from rlcli.backends.embedded import decode_mask, sdpa_decode_attention

    mask = decode_mask(positions, torch.arange(key_len, device=q.device), window)
    return sdpa_decode_attention(q, k_cache, v_cache, mask, scale)


@interpreted
def test_kernel_matches_embedded_sdpa_formulation():
    """A plain contiguous cache (R == n) with finite junk, as the engine's KVCache holds."""
    g = torch.Generator().manual_seed(1)
    n, kvh, group, hd, max_len, key_len = 3, 2, 7, 64, 40, 36
    q = torch.randn(n, kvh * group, hd, generator=g)
    k, v = torch.randn(2, n, kvh, max_len, hd, generator=g)
    pos = torch.tensor([35, 0, 17])
    out = decode_attention(q, k, v, pos, key_len, hd**-0.5, block_n=16)
    torch.testing.assert_close(out, sdpa_decode(q, k, v, pos, key_len, hd**-0.5), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_kernel_in_the_embedded_engine(tmp_path, arch):
    """The engine decoding through the kernel (``attention: triton``, through the
    ``rlcli::decode_attention`` operator) gives the tokens and logprobs of its SDPA path, with a
    sliding window (mistral, window 6 < prompt + response) and continuous batching."""
    import asyncio

    from rlcli.backends.base import BackendContext, GenerateRequest
    from rlcli.backends.embedded import EmbeddedBackend
    from rlcli.testing.backend_conformance import default_context, make_tiny_model_dirs
    from rlcli.types import SampleParams

    if arch == "mistral":
        from transformers import AutoModelForCausalLM, MistralConfig

        cfg = MistralConfig(vocab_size=53, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            sliding_window=6, eos_token_id=1, pad_token_id=0)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
        ctx = BackendContext(str(tmp_path), torch.device("cpu"), torch.float32, eos_token_ids=[1], pad_token_id=0)
    else:
        ctx = default_context(make_tiny_model_dirs(tmp_path, arch=arch, seed=5)[0])
    requests = [GenerateRequest([5 + i, 9, 13, 17, 21][: 1 + i % 5],
                                SampleParams(temperature=0.0 if i % 2 else 1.0, max_tokens=3 + i % 7, ignore_eos=True),
                                seed=i) for i in range(9)]

    async def run(be):
        return await asyncio.gather(*(be.generate(r) for r in requests))

    outs = []
    for attention in ("sdpa", "triton"):
        be = EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=4, attention=attention), ctx)
        assert be.engine.model.triton_attention == (attention == "triton")
        outs.append(asyncio.run(run(be)))
        be.shutdown()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@interpreted
def test_kernel_in_the_embedded_engine_with_shared_prompts(tmp_path, monkeypatch):
    """Samples of one prompt read the prompt's keys and values from one row of their admission
    (``prefix_rows``), through admissions in several waves and rows compacted as responses end:
    the tokens and logprobs are those of the SDPA path, which reads every row's own copy."""
    import asyncio

    import rlcli.backends.decode_attention as DA
    from rlcli.backends.base import GenerateRequest
    from rlcli.backends.embedded import EmbeddedBackend
    from rlcli.testing.backend_conformance import default_context, make_tiny_model_dirs
    from rlcli.types import SampleParams

    ctx = default_context(make_tiny_model_dirs(tmp_path, arch="qwen2", seed=7)[0])
    prompts = [[5, 9, 13, 17, 21, 25, 29], [6, 10, 14], list(range(3, 23))]
    requests = [GenerateRequest(prompts[i % 3], SampleParams(temperature=0.0 if i % 4 == 0 else 1.0,
                                                             max_tokens=2 + (i * 5) % 9, ignore_eos=True), seed=i)
                for i in range(11)]
    seen = []
    real = DA.decode_attention

    def spy(*args, prefix_rows=None, prefix_lens=None, **kw):
        if prefix_rows is not None:
            seen.append((prefix_rows.tolist(), prefix_lens.tolist()))
        return real(*args, prefix_rows=prefix_rows, prefix_lens=prefix_lens, **kw)

    monkeypatch.setattr(DA, "decode_attention", spy)

    async def run(be):
        return await asyncio.gather(*(be.generate(r) for r in requests))

    outs = []
    for attention in ("sdpa", "triton"):
        be = EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=5, attention=attention), ctx)
        outs.append(asyncio.run(run(be)))
        be.shutdown()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # some rows read another row's copy of their prompt, for its whole length
    shared = [(i, r, n) for rows, lens in seen for i, (r, n) in enumerate(zip(rows, lens)) if r != i]
    assert shared and all(n in (3, 7, 20) for _, _, n in shared)


def test_split_rule():
    sms = 132
    assert choose_num_splits(512, 2, 384, sms) == 1  # 1024 programs already fill the GPU
    assert choose_num_splits(300, 2, 4096, sms) == 1
    assert choose_num_splits(64, 2, 4096, sms) == 5  # 128 programs -> 640
    assert choose_num_splits(8, 2, 4096, sms) == 16  # limited by 256 keys per split
    assert choose_num_splits(1, 2, 4096, sms) == 16
    assert choose_num_splits(1, 1, 1 << 20, sms) == MAX_SPLITS
    assert choose_num_splits(8, 2, 300, sms) == 1  # too short to split
    assert choose_num_splits(4, 8, 2048, sms) == 8
    assert choose_num_splits(0, 2, 4096, sms) == 1
    assert choose_num_splits(8, 2, 4096) == choose_num_splits(8, 2, 4096, DEFAULT_SM_COUNT)


def test_availability(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_decode_attention_available(torch.device("cuda"))
    assert triton_decode_attention_available("cuda:0")
    assert not triton_decode_attention_available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_decode_attention_available(torch.device("cpu"))
    assert not triton_decode_attention_available("not a device")  # never raises
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert not triton_decode_attention_available(torch.device("cuda"))


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, rlcli.backends.decode_attention as m\n"
            "assert not m.triton_decode_attention_available(torch.device('cuda'))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rejects_bad_arguments():
    q = torch.zeros(2, 4, 64)
    k = torch.zeros(2, 2, 16, 64)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q, k.half(), k.half(), pos, 8, 1.0)
    with pytest.raises(ValueError, match="incompatible"):
        decode_attention(q, k[:1], k[:1], pos, 8, 1.0)
    with pytest.raises(ValueError, match="key_len"):
        decode_attention(q, k, k, pos, 17, 1.0)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k, k, pos, 8, 1.0, window=0)
    with pytest.raises(ValueError, match="positions"):
        decode_attention(q, k, k, pos[:1], 8, 1.0)
    with pytest.raises(ValueError, match="block_n"):
        decode_attention(q, k, k, pos, 8, 1.0, block_n=24)
    with pytest.raises(ValueError, match="both or neither"):
        decode_attention(q, k, k, pos, 8, 1.0, prefix_rows=pos)
    with pytest.raises(ValueError, match="prefix_lens must be an integer tensor"):
        decode_attention(q, k, k, pos, 8, 1.0, prefix_rows=pos, prefix_lens=pos.float())
    with pytest.raises(ValueError, match="prefix_rows must be an integer tensor of shape"):
        decode_attention(q, k, k, pos, 8, 1.0, prefix_rows=pos[:1], prefix_lens=pos)


def test_benchmark_script_tiny(tmp_path):
    """``benchmarks/decode_attention.py --tiny`` runs (CPU, interpreter) and writes its JSON."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "benchmarks/decode_attention.py", "--tiny", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())["results"]
    # sdpa and triton for both cases, triton_prefix for the rollout case (its rows share a prompt)
    assert [(r["case"], r["path"]) for r in results] == [
        ("rollout", "sdpa"), ("rollout", "triton"), ("rollout", "triton_prefix"), ("long", "sdpa"), ("long", "triton")]
    assert all(row["max_abs_diff"] < 2e-2 for row in results)


def capture_graph(fn, warmups: int = 1):
    """``fn`` run ``warmups`` times on a side stream (kernels built before capture, as torch
    recommends), then one call captured in a CUDA graph: (graph, the call's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(IN_INTERPRETER, reason="TRITON_INTERPRET=1 would interpret the kernel")
@pytest.mark.parametrize("n,key_len,lo,hi", [(512, 384, 64, 320), (8, 4096, 3000, 4095)])
def test_gpu_qwen_decode_shape_and_cuda_graph(n, key_len, lo, hi):
    """Qwen2.5-0.5B decode attention (14 heads, 2 KV heads, head dim 64, bf16) against the SDPA
    formulation, eagerly and replayed from a CUDA graph after changing q and positions in place.
    (512 rows x 384 keys runs unsplit; 8 rows x 4096 keys takes the split-K path.)"""
    dev, dt = torch.device("cuda"), torch.bfloat16
    num_heads, kvh, hd, rows, max_len = 14, 2, 64, n + 16, key_len + 128
    scale = hd**-0.5
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(rows, kvh, max_len, hd, generator=g, device=dev, dtype=dt)
    v_cache = torch.randn(rows, kvh, max_len, hd, generator=g, device=dev, dtype=dt)

    def inputs():
        q = torch.randn(n, num_heads, hd, generator=g, device=dev, dtype=dt)
        pos = torch.randint(lo, hi + 1, (n,), generator=g, device=dev)
        return q, pos

    def close(a, b):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)

    q, pos = inputs()
    close(decode_attention(q, k_cache, v_cache, pos, key_len, scale),
          sdpa_decode(q, k_cache, v_cache, pos, key_len, scale))
    close(decode_attention(q, k_cache, v_cache, pos, key_len, scale, window=100),
          sdpa_decode(q, k_cache, v_cache, pos, key_len, scale, window=100))

    graph, out = capture_graph(lambda: decode_attention(q, k_cache, v_cache, pos, key_len, scale), warmups=2)
    for _ in range(2):
        new_q, new_pos = inputs()
        q.copy_(new_q)
        pos.copy_(new_pos)
        graph.replay()
        torch.cuda.synchronize()
        close(out, sdpa_decode(q, k_cache, v_cache, pos, key_len, scale))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(IN_INTERPRETER, reason="TRITON_INTERPRET=1 would interpret the kernel")
def test_gpu_prefix_rows_under_cuda_graph():
    """A rollout's shape (512 rows, groups of 8 sharing a 64-token prompt, bf16): rows read the
    prompt from the row ``prefix_rows`` names (their own copy is NaN), eagerly and replayed from a
    CUDA graph after the prefix rows changed in place; equal to SDPA over full copies."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    n, num_heads, kvh, hd, key_len, plen = 512, 14, 2, 64, 384, 64
    scale = hd**-0.5
    g = torch.Generator(device=dev).manual_seed(0)
    full_k = torch.randn(n, kvh, key_len, hd, generator=g, device=dev, dtype=dt)
    full_v = torch.randn(n, kvh, key_len, hd, generator=g, device=dev, dtype=dt)
    first = torch.arange(n, device=dev) // 8 * 8
    full_k[:, :, :plen], full_v[:, :, :plen] = full_k[first, :, :plen], full_v[first, :, :plen]
    k_cache, v_cache = full_k.clone(), full_v.clone()
    k_cache[first != torch.arange(n, device=dev), :, :plen] = float("nan")  # only each group's first row holds it
    v_cache[first != torch.arange(n, device=dev), :, :plen] = float("nan")
    q = torch.randn(n, num_heads, hd, generator=g, device=dev, dtype=dt)
    pos = torch.randint(plen, 321, (n,), generator=g, device=dev)
    rows, lens = first.clone(), torch.full((n,), plen, dtype=torch.int32, device=dev)

    def run():
        return decode_attention(q, k_cache, v_cache, pos, key_len, scale, prefix_rows=rows, prefix_lens=lens)

    def close(out):
        torch.testing.assert_close(out.float(), sdpa_decode(q, full_k, full_v, pos, key_len, scale).float(),
                                   atol=2e-2, rtol=2e-2)

    close(run())
    graph, out = capture_graph(run)
    # the groups' second rows now hold the prompt instead, and the prefix rows say so
    second = first + 1
    k_cache[:, :, :plen], v_cache[:, :, :plen] = float("nan"), float("nan")
    k_cache[second, :, :plen], v_cache[second, :, :plen] = full_k[second, :, :plen], full_v[second, :, :plen]
    rows.copy_(second)
    q.copy_(torch.randn(n, num_heads, hd, generator=g, device=dev, dtype=dt))
    graph.replay()
    torch.cuda.synchronize()
    close(out)
