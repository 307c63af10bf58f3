"""``train_worker.optimizer.moment_dtype``: AdamW with its moments stored in bfloat16 (MomentDtypeAdamW)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlcli.algo.loss import VanillaPolicyLoss
from rlcli.config import ModelConfig, TrainWorkerConfig
from rlcli.models import tiny_model_dir
from rlcli.train import checkpoint as ckpt
from rlcli.train.optim import MomentDtypeAdamW
from rlcli.train.worker import TrainWorker

from .test_train_worker import make_batch


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (11,), (3, 4, 2), (0,)]
    transposed = torch.nn.Parameter((torch.randn(5, 7, generator=g) * 0.02).t())  # not contiguous: updated whole
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes] + [transposed]


def _run(opt_cls, steps: int = 6, **kw) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = _params(0)
    opt = opt_cls(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("chunk", [7, 1 << 24])  # chunked or whole: elementwise, so the same numbers
def test_float32_moments_are_torch_adamw_bit_for_bit(chunk):
    want, ref = _run(torch.optim.AdamW, foreach=False)
    got, opt = _run(MomentDtypeAdamW, moment_dtype=torch.float32, chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for p_ref, p in zip(ref.param_groups[0]["params"], opt.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[p_ref][k], opt.state[p][k]), k


def test_bfloat16_moments_halve_the_state_and_stay_close_to_float32_adamw():
    want, _ = _run(torch.optim.AdamW, foreach=False)
    got, opt = _run(MomentDtypeAdamW, moment_dtype=torch.bfloat16, chunk=7)
    for p in opt.param_groups[0]["params"]:
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 and p.dtype == torch.float32
    start = _params(0)
    for a, b, p0 in zip(want, got, start):
        if p0.numel():
            moved = (a - p0).abs().max()
            assert moved > 1e-3  # six steps of lr 1e-2 move every weight
            assert (a - b).abs().max() < 0.05 * moved  # bf16 moments: within a few % of the float32 path


def test_a_zero_learning_rate_moves_nothing():
    """What torch's distributed checkpoint does to create the state before loading into it."""
    params = _params(3)
    before = [p.detach().clone() for p in params]
    opt = MomentDtypeAdamW(params, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("m16") / "m", arch="qwen2", seed=5)


def _worker(model_dir, optimizer_steps=2, total_steps=6) -> TrainWorker:
    cfg = TrainWorkerConfig(optimizer={"lr": 1e-2, "weight_decay": 0.01, "moment_dtype": "bfloat16"},
                            optimizer_steps=optimizer_steps, lr_scheduler={"name": "cosine", "warmup_steps": 2})
    return TrainWorker(model_dir, ModelConfig(), cfg, VanillaPolicyLoss(), device="cpu", seed=0,
                       total_steps=total_steps)


def _logp_of_target(w: TrainWorker, seqs) -> float:
    lps = w.compute_logprobs(seqs)
    return sum(lp[0] for s, lp in zip(seqs, lps) if s.advantage > 0) / sum(s.advantage > 0 for s in seqs)


def test_train_worker_learns_with_bfloat16_moments(model_dir):
    w = _worker(model_dir)
    assert isinstance(w.optimizer, MomentDtypeAdamW)
    seqs = make_batch(n=32, seed=0)
    before = _logp_of_target(w, seqs)
    for _ in range(3):
        m = w.train_step(seqs)
        assert m["train/skipped_steps"] == 0 and math.isfinite(m["train/loss"])
    assert _logp_of_target(w, seqs) > before + 0.5
    moments = [v for st in w.optimizer.state.values() for k, v in st.items() if k.startswith("exp_avg")]
    assert moments and all(isinstance(v, DTensor) and v.dtype == torch.bfloat16 for v in moments)


def test_a_non_finite_step_leaves_the_bfloat16_moments_untouched(model_dir):
    w = _worker(model_dir, optimizer_steps=1)
    w.train_step(make_batch(n=8, seed=1))
    snap = {id(p): {k: v.full_tensor().clone() if isinstance(v, DTensor) else v.clone() for k, v in st.items()}
            for p, st in w.optimizer.state.items()}
    bad = make_batch(n=8, seed=2)
    bad[0].advantage = float("nan")
    assert w.train_step(bad)["train/skipped_steps"] == 1
    for p, st in w.optimizer.state.items():
        for k, v in st.items():
            assert torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, snap[id(p)][k]), k


def test_exact_resume_with_bfloat16_moments(model_dir, tmp_path):
    a = _worker(model_dir)
    batches = [make_batch(n=16, seed=s) for s in range(4)]
    for b in batches[:2]:
        a.train_step(b)
    path = a.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2})
    expected = [{k: v for k, v in a.train_step(b).items() if k != "train/step_time_s"} for b in batches[2:]]
    b = _worker(model_dir)
    b.load_checkpoint(path)
    got = [{k: v for k, v in b.train_step(x).items() if k != "train/step_time_s"} for x in batches[2:]]
    assert got == expected
    wa, wb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    moments = [v for st in b.optimizer.state.values() for k, v in st.items() if k.startswith("exp_avg")]
    assert moments and all(v.dtype == torch.bfloat16 for v in moments)  # not cast to the weights' float32


def test_a_float32_moment_state_loads_into_bfloat16_moments():
    """A run resumed with ``moment_dtype: bfloat16`` from a checkpoint of float32 moments."""
    _, ref = _run(torch.optim.AdamW, steps=2, foreach=False)
    params = _params(0)
    opt = MomentDtypeAdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    saved = ref.state_dict()
    # a step count stored otherwise than on the host in float32 (a fused AdamW keeps it on the device)
    saved = {**saved, "state": {i: {**st, "step": st["step"].double()} for i, st in saved["state"].items()}}
    opt.load_state_dict(saved)
    for p_ref, p in zip(ref.param_groups[0]["params"], params):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and float(st["step"]) == float(ref.state[p_ref]["step"]) == 2
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32
        assert torch.equal(st["exp_avg_sq"], ref.state[p_ref]["exp_avg_sq"].to(torch.bfloat16))


@pytest.mark.gpu
def test_bfloat16_moments_on_cuda_follow_the_fused_float32_adamw(model_dir):
    seqs = make_batch(n=32, seed=4)

    def run(moment_dtype: str):
        cfg = TrainWorkerConfig(optimizer={"lr": 1e-3, "moment_dtype": moment_dtype})
        w = TrainWorker(model_dir, ModelConfig(), cfg, VanillaPolicyLoss(), device="cuda", seed=0, total_steps=10)
        return w, [w.train_step(seqs)["train/loss"] for _ in range(4)]

    (w32, l32), (w16, l16) = run("float32"), run("bfloat16")
    assert isinstance(w16.optimizer, MomentDtypeAdamW) and not isinstance(w32.optimizer, MomentDtypeAdamW)
    assert l16[0] == l32[0] and l16[-1] == pytest.approx(l32[-1], rel=0.05, abs=1e-3)
    moments = [v for st in w16.optimizer.state.values() for k, v in st.items() if k.startswith("exp_avg")]
    assert all(v.to_local().is_cuda and v.dtype == torch.bfloat16 for v in moments)
