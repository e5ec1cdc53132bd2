"""The evaluation CLIs as a user runs them: ``eval_suites.run`` (which runs the real lmms-eval CLI
in a subprocess) on a tiny random checkpoint, its failure exits, the task-data builder and the
text-eval CLI's argument checks.

The unknown-task run is started in the background before the end-to-end run, so the two
lmms-eval processes share the two CPU cores instead of running one after the other.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from _eval_helpers import (
    REPO,
    default_data_dir,
    session_checkpoint,
    session_eval_data,
)

pytest.importorskip("lmms_eval")


def _env(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               LMMS_EVAL_DATASETS_CACHE=str(tmp_path_factory.getbasetemp() / "hf_datasets_cache"),
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def _run_cmd(paths, ckpt, out_root, tasks, *extra):
    data_dir, eval_data = paths
    return [sys.executable, "-m", "eval_suites.run", "--checkpoint", ckpt, "--tasks", tasks,
            "--data", data_dir, "--eval-data", eval_data, "--out-root", str(out_root), "--name", "run",
            "--device", "cpu", "--batch-size", "10", *extra]


@pytest.fixture(scope="module")
def setup_paths(tmp_path_factory):
    data_dir = default_data_dir(tmp_path_factory)
    # parquet files in the session temp dir (run.py would otherwise build <data>/eval in the repo)
    return (data_dir, session_eval_data(tmp_path_factory)), session_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def unknown_task_run(setup_paths, tmp_path_factory):
    """eval_suites.run on a task lmms-eval does not know, started in the background."""
    paths, ckpt = setup_paths
    out_root = tmp_path_factory.mktemp("eval_unknown")
    proc = subprocess.Popen(_run_cmd(paths, ckpt, out_root, "cmoe_digits_vqa,no_such_task_xyz", "--quiet"),
                            cwd=str(REPO), env=_env(tmp_path_factory), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc, out_root
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _samples(run_dir, task: str) -> list[dict]:
    """The per-sample records lmms-eval logged for ``task`` (one jsonl file)."""
    files = glob.glob(str(run_dir / "**" / f"*_samples_{task}.jsonl"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mme_local_task(tasks_dir, data_dir) -> bool:
    """eval_suites/README.md recipe B: lmms-eval's built-in MME task on a local parquet copy (here: 2 digit images
    as one MME question pair). False when the installed lmms-eval has no MME YAML."""
    import datasets
    import lmms_eval

    mme_yaml = os.path.join(os.path.dirname(lmms_eval.__file__), "tasks", "mme", "mme.yaml")
    if not os.path.isfile(mme_yaml):
        return False
    folder = tasks_dir / "mme_local"
    folder.mkdir()
    with open(os.path.join(data_dir, "images", "digits", "2.png"), "rb") as f:
        png = f.read()
    rows = {"question_id": ["digits/2.png"] * 2, "image": [{"bytes": png, "path": None}] * 2,
            "question": ["Is the digit 2? Please answer yes or no.", "Is the digit 5? Please answer yes or no."],
            "answer": ["Yes", "No"], "category": ["count", "count"]}
    features = datasets.Features({"question_id": datasets.Value("string"), "image": datasets.Image(),
                                  "question": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "category": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / "test-00000.parquet"))
    (folder / "mme_local.yaml").write_text(
        f"task: mme_local\ninclude: {mme_yaml}\ndataset_path: parquet\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder}/test-*.parquet\n")
    return True


@pytest.mark.slow
def test_run_end_to_end_with_real_lmms_eval_cli(setup_paths, unknown_task_run, tmp_path_factory):
    """Both local tasks + a built-in lmms-eval task (MME) on local parquet, in one real CLI run.

    lmms-eval takes one include folder, so this run uses a copy of eval_suites/tasks/cmoe_digits
    next to the MME recipe; the unknown-task run below uses the default eval_suites/tasks.
    """
    paths, ckpt = setup_paths
    tasks_dir = tmp_path_factory.mktemp("eval_tasks")
    shutil.copytree(REPO / "eval_suites" / "tasks" / "cmoe_digits", tasks_dir / "cmoe_digits",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with_mme = _mme_local_task(tasks_dir, paths[0])
    tasks = "cmoe_digits_vqa,cmoe_digits_mc" + (",mme_local" if with_mme else "")
    out_root = tmp_path_factory.mktemp("eval_e2e")
    proc = subprocess.run(_run_cmd(paths, ckpt, out_root, tasks, "--limit", "2", "--tasks-dir", str(tasks_dir)),
                          cwd=str(REPO), env=_env(tmp_path_factory), check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "-m lmms_eval " in proc.stdout or "-m eval_suites.lmms_cli " in proc.stdout
    run_dir = out_root / "run"
    results = json.loads((run_dir / "results.json").read_text())
    vqa, mc = results["results"]["cmoe_digits_vqa"], results["results"]["cmoe_digits_mc"]
    assert results["n-samples"]["cmoe_digits_vqa"]["effective"] == 2
    assert results["n-samples"]["cmoe_digits_mc"]["effective"] == 2
    # The checkpoint is random (nothing learned), so the accuracies are not compared with chance:
    # what is checked is that each reported number is what the logged samples say it is.
    from eval_suites.tasks.cmoe_digits.utils import normalize_answer

    vqa_rows = _samples(run_dir, "cmoe_digits_vqa")
    assert len(vqa_rows) == 2
    for row in vqa_rows:  # a hit iff the normalised reply equals the normalised answer
        reply = row["filtered_resps"]  # the reply string (a list of one in some lmms-eval versions)
        while isinstance(reply, list):
            reply = reply[0]
        assert row["exact_match"] == float(normalize_answer(reply) == normalize_answer(row["target"])), row
    assert vqa["exact_match,none"] == pytest.approx(sum(r["exact_match"] for r in vqa_rows) / 2)
    mc_rows = _samples(run_dir, "cmoe_digits_mc")
    assert len(mc_rows) == 2
    for row in mc_rows:  # the plugin returns per-choice losses; lmms-eval picks the lowest
        losses = [float(resp[0]) for resp in row["filtered_resps"]]  # numeric pairs, not "(x, y)" strings
        assert len(losses) == 10 and all(x > 0 for x in losses), losses
        assert row["acc"] == float(losses.index(min(losses)) == int(row["target"])), (losses, row["target"])
    assert mc["acc,none"] == pytest.approx(sum(r["acc"] for r in mc_rows) / 2)
    if with_mme:  # one question pair: 100 * (mean hit + both hit)
        hits = [r["mme_perception_score"]["score"] for r in _samples(run_dir, "mme_local")]
        assert len(hits) == 2 and set(hits) <= {0.0, 1.0}, hits
        want = 100.0 * (sum(hits) / 2 + (sum(hits) == 2))
        assert results["results"]["mme_local"]["mme_perception_score,none"] == pytest.approx(want)
    assert "cmoe_digits_mc" in proc.stdout and "exact_match" in proc.stdout  # the printed table
    assert (run_dir / "lmms_eval.log").is_file()
    # make eval's CPU thread policy reached the model inside lmms-eval (tests/unit/eval_suites/test_eval_threads.py)
    assert "[conceptmoe_vlm] cpu threads: 1 (cpu_threads=1)" in (run_dir / "lmms_eval.log").read_text()


@pytest.mark.slow
def test_run_fails_on_unknown_task(unknown_task_run):
    proc, out_root = unknown_task_run
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert "unknown task(s): no_such_task_xyz;" in stderr  # cmoe_digits_vqa was found in eval_suites/tasks
    assert not (out_root / "run" / "results.json").exists()


@pytest.mark.parametrize("make_bad", ["missing", "no_config", "lm_only"])
def test_run_fails_fast_on_broken_checkpoint(make_bad, tmp_path, setup_paths, tmp_path_factory):
    bad = tmp_path / "ckpt"
    if make_bad != "missing":
        bad.mkdir()
        (bad / "model.safetensors").write_bytes(b"")
    if make_bad == "lm_only":
        (bad / "config.json").write_text(json.dumps({"model_type": "conceptmoe"}))
    proc = subprocess.run(_run_cmd(setup_paths[0], str(bad), tmp_path / "out", "cmoe_digits_vqa"),
                          cwd=str(REPO), env=_env(tmp_path_factory), check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0]
    assert not (tmp_path / "out").exists()  # nothing was started


def test_build_tasks_is_idempotent_and_embeds_images(tmp_path, setup_paths):
    import datasets
    from PIL import Image

    from eval_suites.build_tasks import MC_FILE, VQA_FILE, build

    data_dir = setup_paths[0][0]
    out = str(tmp_path / "eval")
    manifest = build(data_dir, out, quiet=True)
    assert manifest["files"] == {VQA_FILE: 540, MC_FILE: 180}
    stamp = os.path.getmtime(os.path.join(out, "manifest.json"))
    assert build(data_dir, out, quiet=True) is None  # second run: nothing to do
    assert os.path.getmtime(os.path.join(out, "manifest.json")) == stamp
    mc = datasets.load_dataset("parquet", data_files={"test": os.path.join(out, MC_FILE)},
                               cache_dir=str(tmp_path / "cache"), split="test")
    row = mc[0]
    assert isinstance(row["image"], Image.Image)
    assert row["choices"] == [str(d) for d in range(10)] and row["choices"][row["label"]] == row["answer"]
    with open(os.path.join(data_dir, "digits_test.json")) as f:
        first = json.load(f)[0]
    expected = Image.open(os.path.join(data_dir, "images", first["image"]))
    assert row["image"].tobytes() == expected.tobytes()  # the real PNG, embedded


def test_text_eval_cli_checks_arguments(tmp_path, setup_paths):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    missing = subprocess.run([sys.executable, "-m", "eval_suites.text_eval", "--checkpoint", str(tmp_path / "nope"),
                              "--text", "x.txt"], cwd=str(REPO), env=env, check=False, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "checkpoint folder not found" in missing.stderr
    no_text = subprocess.run([sys.executable, "-m", "eval_suites.text_eval", "--checkpoint", setup_paths[1],
                              "--text", str(tmp_path / "none.txt")], cwd=str(REPO), env=env,
                             check=False, capture_output=True, text=True, timeout=120)
    assert no_text.returncode == 2 and "text file not found" in no_text.stderr


def test_text_eval_end_to_end(setup_paths, tmp_path):
    from eval_suites.text_eval import evaluate_text

    text = tmp_path / "held_out.txt"
    text.write_text("Double, double toil and trouble;\nFire burn and caldron bubble.\n" * 6, encoding="utf-8")
    result = evaluate_text(setup_paths[1], str(text), seq_len=48, batch_size=4)
    assert result["bytes"] == len(text.read_bytes())
    assert result["bits_per_byte"] == pytest.approx(result["nll_per_token"] * result["tokens"]
                                                    / (result["bytes"] * 0.6931471805599453))
    assert 1.0 <= result["compression_ratio"] <= 48 and result["target_ratio"] == 2.0
    assert result["perplexity"] > 1.0
