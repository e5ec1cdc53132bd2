"""Expert parallelism (vlm/training/expert_parallel.py) on CPU / gloo: the same losses and parameters
as plain data parallelism on the same ranks and global batch, exact resume under EP, the export
gathers every expert, the end-of-run VQA eval of a VLM runs with and without an export (no hang).
The in-process EP tests (the 1-rank dispatch, the refusals) are in tests/unit/training/test_expert_parallel_dispatch.py."""
from __future__ import annotations

import glob
import json
import os

from safetensors.torch import load_file

import _train_helpers as helpers
from _eval_helpers import default_data_dir
from vlm.modeling.config_base import read_yaml
from vlm.config.train import REPO_ROOT

STEPS = 10
# AdamW's m / (sqrt(v) + eps) turns the last-bit differences of a near-cancelling expert gradient
# (EP sums both ranks' rows in one GEMM, DP sums two GEMMs) into lr-sized steps when eps is 1e-8;
# eps 1e-6 keeps those updates proportional to the gradient, so the comparison sees the dispatch only
EPS = 1.0e-6
# concept layers route top-3 (token layers top-2), plus a shared expert: all of it under EP
MODEL = {"chunking.concept_top_k": 3, "moe.shared_expert_intermediate_size": 32}


def _train(tmp, name, nproc, ep, args=(), **extra):
    raw = helpers.config(tmp, name=name, train={"max_steps": STEPS, "eps": EPS, **extra.pop("train", {})},
                         model=MODEL,
                         checkpoint={"every_steps": 5, "keep_last": 3, "export_hf": True},
                         parallel={"expert_parallel_size": ep}, **extra)
    proc = helpers.launch(helpers.write_config(tmp, raw, f"{name}.yaml"), nproc=nproc, args=args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc


def _params(run_dir):
    return load_file(glob.glob(str(run_dir / "hf" / "*.safetensors"))[0])


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _loss_diff(ra, rb) -> float:
    la, lb = helpers.losses(ra), helpers.losses(rb)
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    return max(abs(la[s] - lb[s]) for s in la)


def _compare(ref, run, nproc, ep):
    dl, dp = _loss_diff(ref, run), _max_diff(_params(ref), _params(run))
    print(f"{nproc} ranks, EP={ep} vs DP: max |loss diff| {dl:.2e}, max |param diff| {dp:.2e}")
    assert dl <= 1e-5 and dp <= 1e-5


def test_ep_two_ranks_matches_data_parallel_and_resumes_exactly(tmp_path):
    ref, run = tmp_path / "dp2", tmp_path / "ep2"
    _train(tmp_path, ref.name, 2, 1)
    proc = _train(tmp_path, run.name, 2, 2)
    assert "sharded over groups of 2 ranks" in proc.stdout
    _compare(ref, run, 2, 2)
    files = [p.name for p in (run / "ckpt" / "step_000005").iterdir()]
    assert sum(n.startswith("layer_") and "_expert_" in n for n in files) == 4 * 8  # DeepSpeed: a file per expert
    resumed = tmp_path / "resumed"
    _train(tmp_path, resumed.name, 2, 2, args=("--resume", str(run / "ckpt" / "step_000005")))
    la, lb = helpers.losses(run), helpers.losses(resumed)
    assert [la[s] for s in range(6, STEPS + 1)] == [lb[s] for s in range(6, STEPS + 1)]
    assert _max_diff(_params(run), _params(resumed)) == 0.0


def test_ep_four_ranks_matches_data_parallel(tmp_path):
    """EP = 2 on 4 ranks: two expert-parallel groups, expert gradients reduced over expert-data-parallel
    pairs; EP = 4 also recomputes every block in the backward (all-to-alls included)."""
    ref = tmp_path / "dp4"
    _train(tmp_path, ref.name, 4, 1)
    for ep, train in ((2, {}), (4, {"activation_checkpointing": "full"})):
        run = tmp_path / f"ep{ep}_of_4"
        _train(tmp_path, run.name, 4, ep, train=train)
        _compare(ref, run, 4, ep)


def test_ep_vlm_end_of_run_eval_with_and_without_export(tmp_path, tmp_path_factory):
    """The VLM's held-out eval after an EP run: without an export rank 0 alone cannot run the sharded
    live model (its all-to-all waits for rank 1, which waits at the barrier: a hang), so it scores an
    unsharded copy of the gathered weights; with an export it scores the export. Same weights, same
    scores. The periodic eval and the boundary picture (rank 0 too) run on such a copy. A hang fails
    at the launch timeout."""
    data = default_data_dir(tmp_path_factory)
    base = read_yaml(REPO_ROOT / "configs" / "train" / "default.yaml")
    scores = {}
    for export in (False, True):
        name = f"ep_vlm_export_{str(export).lower()}"
        raw = helpers.config(tmp_path, base=base, name=name, data={"root": data},
                             model={"tokenizer": os.path.join(data, "tokenizer")},
                             train={"max_steps": 2, "micro_batch_size": 4, "warmup_steps": 1},
                             log={"every_steps": 1, "progress_bar": False, "report_to": ["jsonl"],
                                  "visualize_every": 0 if export else 1},
                             checkpoint={"every_steps": 0, "save_final": False, "export_hf": export},
                             eval={"every_steps": 0 if export else 1, "periodic_limit": 3,
                                   "limit": 6, "batch_size": 6, "max_new_tokens": 2,
                                   "vqa_json": os.path.join(data, "digits_test.json"),
                                   "image_root": os.path.join(data, "images")},
                             parallel={"expert_parallel_size": 2})
        proc = helpers.launch(helpers.write_config(tmp_path, raw, f"{name}.yaml"), nproc=2, timeout=240)
        assert proc.returncode == 0, proc.stdout[-4000:]
        gathered = "[train] eval: on an unsharded copy of the gathered weights (expert parallelism, no export)"
        assert (gathered in proc.stdout) != export
        assert (tmp_path / name / "hf" / "config.json").is_file() == export
        if not export:  # periodic eval at step 1 (not the last), pictures at steps 1 and 2
            lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            periodic = [r for r in map(json.loads, lines) if "eval_vqa_accuracy" in r]
            assert [r["step"] for r in periodic] == [1] and "held-out VQA" in proc.stdout
            assert sorted(p.name for p in (tmp_path / name / "boundaries").iterdir()) == [
                "step_000001.png", "step_000002.png"]
        ev = json.loads((tmp_path / name / "summary.json").read_text())["eval"]
        assert ev["total"] == 6
        scores[export] = {k: ev[k] for k in ("correct", "ratio", "ratio_image", "ratio_text", "examples")}
    assert scores[False] == scores[True]
