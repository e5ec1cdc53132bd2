"""Resume at another world size (``vlm/training/reshard.py``, DeepSpeed's universal checkpoint):
2 ranks -> 1 and 1 -> 2 continue exactly like the uninterrupted run at the same global batch; the
ZeRO-3's universal load is exact after our repair; ZeRO stage 0 is refused in one line. (The data
position and the new ranks' RNG states, no training: tests/unit/training/test_reshard.py.)

The runs read a real mixture (a text file) with micro-batches of one sample, so that both world
sizes compute the same thing: rank r of W reads global positions local * W + r, so 2 ranks x accum
1 and 1 rank x accum 2 both take positions 2s and 2s + 1 at step s, one sample per micro-batch
(with larger micro-batches the two group samples differently -- evens / odds vs halves -- and the
per-micro-batch token means and MoE / ratio losses then differ by ~1e-2 without any resume). The
chunker's boundary noise is off (``boundary_noise_tau: 0``): it draws from each rank's RNG stream,
which differs between world sizes by construction."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import _train_helpers as helpers
import pytest
import torch
from _data_helpers import TINY_CORPUS, tiny_tokenizer

from vlm.training import checkpoint as ckpt
from vlm.training import reshard

# Resumed run vs the uninterrupted run it was cut from (steps 4-6 of 6, fp32 on CPU): equal bit for bit.
# 2 ranks x accum 1 and 1 rank x accum 2 take the same gradient, (a + b) / 2 vs a / 2 + b / 2 (halving is
# exact), and AdamW updates each element alone, whatever the partition layout. The one thing that follows
# the layout is the order of the gradient-norm sum (2 partitions vs 1), and through the clip factor it
# reached every update (last-bit differences, ~2.4e-7 on the loss, amplified at a CPU-dependent step):
# gradient clipping is off in these runs, so the norm is only logged. Checked equal with torch's
# AVX512 and AVX2 kernels (ATEN_CPU_CAPABILITY). A fresh Adam state, a lost LR schedule position or a
# data position off by one sample moves the loss by > 1e-2.


def _data(root: Path) -> dict:
    """A tiny tokenizer and a text file of 400 lines (deterministic)."""
    root.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(str(root / "tok"))
    rng = random.Random(0)
    words = " ".join(TINY_CORPUS).split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"tok": root / "tok", "txt": root / "corpus.txt"}


def _raw(tmp: Path, data: dict, name: str, accum: int, zero: str = "zero2", **sections) -> dict:
    """The tiny ConceptMoE LM (boundary noise off) on the text mixture, micro-batch 1, no gradient
    clipping (the comment above), 6 steps, checkpoints at 3 and 6."""
    raw = helpers.config(tmp, name=name, deepspeed=zero,
                         model={"tokenizer": str(data["tok"]), "chunking": {"boundary_noise_tau": 0}},
                         data={"kind": "mixture", "max_length": 32, "packing": False,
                               "datasets": [{"name": "corpus", "type": "text", "path": str(data["txt"])}]},
                         train={"micro_batch_size": 1, "grad_accum": accum, "grad_clip": 0.0},
                         checkpoint={"every_steps": 3, "keep_last": 3})
    return helpers.config(tmp, base=raw, **sections)


def _run(tmp: Path, raw: dict, nproc: int, resume: Path | None = None, launcher: str = "torchrun"):
    args = ["--resume", str(resume)] if resume else []
    proc = helpers.launch(helpers.write_config(tmp, raw, f"{raw['name']}.yaml"), nproc=nproc, args=args,
                          launcher="python" if nproc == 1 else launcher, timeout=300)
    return proc


def _weights(run: Path, step: int) -> dict:
    sd = torch.load(run / "ckpt" / ckpt.step_dir_name(step) / "mp_rank_00_model_states.pt", map_location="cpu",
                    weights_only=False)["module"]
    return {k: v.float() for k, v in sd.items()}


def _compare(resumed: Path, ref: Path, what: str = "resumed") -> tuple[float, float]:
    """Max |loss diff| over steps 4-6 and max |param diff| after step 6; asserts both are 0."""
    got, want = helpers.losses(resumed), helpers.losses(ref)
    assert {4, 5, 6} <= set(got), got
    loss_d = max(abs(got[s] - want[s]) for s in (4, 5, 6))
    a, b = _weights(resumed, 6), _weights(ref, 6)
    assert a.keys() == b.keys()
    param_d = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"{what}: {resumed.name} vs {ref.name}: max |loss diff| {loss_d:.2e}, max |param diff| {param_d:.2e}")
    assert loss_d == 0.0 and param_d == 0.0, (what, loss_d, param_d)
    return loss_d, param_d


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return _data(tmp_path_factory.mktemp("rws_data"))


def _uninterrupted(data, tmp_path_factory, name: str, nproc: int, accum: int) -> Path:
    tmp = tmp_path_factory.mktemp(f"rws_{name}")
    proc = _run(tmp, _raw(tmp, data, name, accum), nproc)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / name


@pytest.fixture(scope="module")
def two_run(data, tmp_path_factory) -> Path:
    """Uninterrupted: 2 ranks x accum 1 x micro-batch 1."""
    return _uninterrupted(data, tmp_path_factory, "two", 2, 1)


@pytest.fixture(scope="module")
def one_run(data, tmp_path_factory) -> Path:
    """Uninterrupted: 1 rank x accum 2 x micro-batch 1 (the same samples in every step and micro-batch)."""
    return _uninterrupted(data, tmp_path_factory, "one", 1, 2)


def test_two_ranks_to_one(data, two_run, one_run, tmp_path):
    """`python -m vlm.train --resume <2-rank step 3>` on 1 rank x accum 2 converts the checkpoint once
    (one line) and continues to step 6 like the uninterrupted 2-rank run; a later resume at another
    world size reuses the conversion."""
    step3 = two_run / "ckpt" / "step_000003"
    proc = _run(tmp_path, _raw(tmp_path, data, "a", 2), 1, resume=step3)
    assert proc.returncode == 0, proc.stdout[-4000:]
    said = [line for line in proc.stdout.splitlines() if "universal checkpoint" in line]
    assert len(said) == 1 and "written by 2 ranks, this run has 1: converted it once" in said[0], said
    assert (step3 / "universal" / "zero" / "optimizer_state.pt").is_file() and ckpt.is_complete(step3)
    assert not (step3 / "universal.tmp").exists() and not (step3 / "latest_universal").exists()
    _compare(tmp_path / "a", two_run)
    _compare(one_run, two_run, what="regrouping only (no resume)")
    # the new run's checkpoints are plain 1-rank ones
    state = json.loads((tmp_path / "a" / "ckpt" / "step_000006" / ckpt.TRAINER_STATE).read_text())
    assert state["world_size"] == 1 and state["step"] == 6
    # a second resume at another world size reuses the conversion
    said, ds = [], {}
    assert reshard.prepare(step3, 3, 2, ds, rank=0, log_line=said.append) == step3 / "universal"
    assert ds == {"checkpoint": {"load_universal": True}} and len(said) == 1 and "loading its universal" in said[0]


def test_one_rank_to_two(data, one_run, tmp_path):
    """The deepspeed launcher on 2 ranks x accum 1 resumes the 1-rank checkpoint of step 3 (rank 1
    did not exist: derived RNG state) and continues like the uninterrupted 1-rank run."""
    proc = _run(tmp_path, _raw(tmp_path, data, "c", 1), 2, resume=one_run / "ckpt" / "step_000003",
                launcher="deepspeed")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "written by 1 ranks, this run has 2: converted it once" in proc.stdout
    _compare(tmp_path / "c", one_run)


def _forge_two_rank_copy(src: Path, dst: Path) -> Path:
    """A copy of a 1-rank checkpoint that claims 2 ranks (trainer_state world_size 2, rank 1's file
    = rank 0's), so that a 1-rank resume takes the universal path with nothing else changed."""
    shutil.copytree(src, dst)
    state = json.loads((dst / ckpt.TRAINER_STATE).read_text())
    state["world_size"] = 2
    (dst / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    shutil.copy(dst / ckpt.rank_file(0), dst / ckpt.rank_file(1))
    return dst


def test_zero3_universal_load_is_exact(tmp_path):
    """In process, 1 rank, ZeRO-3 with per-group weight decay / LR multipliers: loading the universal
    conversion gives the exact resume's losses bit for bit. Without the repair of DeepSpeed's ZeRO-3
    universal load (reshard._repair_zero3_groups: a shared Adam step tensor, group 0's
    hyper-parameters in every group) the second resumed step is off by ~2e-2."""
    base = dict(deepspeed="zero3", train={"max_steps": 4, "grad_accum": 2, "weight_decay": 0.1,
                                          "lr_mult": {"chunker": 0.5}}, checkpoint={"every_steps": 2})
    helpers.run_inprocess(helpers.config(tmp_path, name="full", **base), tmp_path)
    step2 = tmp_path / "full" / "ckpt" / "step_000002"
    forged = _forge_two_rank_copy(step2, tmp_path / "forged" / "step_000002")
    tr = helpers.run_inprocess(helpers.config(tmp_path, name="univ", **base), tmp_path, resume=str(forged))
    assert tr.universal == forged / "universal"
    full, univ = helpers.losses(tmp_path / "full"), helpers.losses(tmp_path / "univ")
    assert sorted(univ) == [3, 4] and all(univ[s] == full[s] for s in (3, 4)), (univ, full)


def test_zero_stage0_is_refused_in_one_line(tmp_path, capsys):
    """ZeRO stage 0 has no ZeRO optimizer for DeepSpeed's converter: one error line, exit code 2,
    and nothing written into the checkpoint."""
    from vlm.train import main

    over = {"zero_optimization": {"stage": 0}}
    raw = helpers.config(tmp_path, name="z0", deepspeed_overrides=over, train={"max_steps": 2},
                         checkpoint={"every_steps": 0})
    helpers.run_inprocess(raw, tmp_path)
    forged = _forge_two_rank_copy(tmp_path / "z0" / "ckpt" / "step_000002", tmp_path / "forged" / "step_000002")
    capsys.readouterr()
    path = helpers.write_config(tmp_path, helpers.config(tmp_path, name="z0b", deepspeed_overrides=over), "b.yaml")
    assert main(["--config", str(path), "--resume", str(forged)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "cannot resume on 1 ranks under ZeRO stage 0" in err[0], err
    assert not (forged / "universal").exists()
