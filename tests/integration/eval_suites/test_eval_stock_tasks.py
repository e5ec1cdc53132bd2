"""lmms-eval's stock task definitions (the YAML + utils.py shipped in the installed package, unedited)
run offline through the real ``python -m lmms_eval`` CLI on a tiny random checkpoint.

Each task's data is a few rows written here with the data set's real schema (columns, types,
image encoding that the task's ``doc_to_visual`` / ``doc_to_text`` / ``process_results`` read;
images drawn with PIL), put into a test ``HF_HOME`` datasets cache by ``eval_suites.stock_data``
(the recipe of docs/evaluation.md), so ``load_dataset("lmms-lab-encoder/MME")`` resolves offline to these rows.

Two CLI runs share the two CPU cores: ``python -m lmms_eval`` (simple interface) on seven
generation tasks + one text-only ``multiple_choice`` MMLU subject (loglikelihood path), and
``make eval``'s ``eval_suites.run --hf-home`` (which runs that CLI) with the chat interface
(``interface=chat``: lmms-eval builds the requests from ``doc_to_messages``) on mmmu_val and mme.
The model is random, so only that each metric is computed (present and finite) is asserted;
the values are printed (``pytest -s``).
"""
from __future__ import annotations

import glob
import io
import json
import math
import os
import subprocess
import sys

import pytest
from _eval_helpers import REPO, session_checkpoint

pytest.importorskip("lmms_eval")

# task -> the metric keys its results must hold (lmms-eval's "<metric>,<filter>" names)
SIMPLE_TASKS = {
    "mme": ["mme_perception_score,none"],
    "pope": ["pope_accuracy,none", "pope_f1_score,none"],
    "scienceqa_img": ["exact_match,none"],
    "ai2d": ["exact_match,flexible-extract"],
    "seedbench": ["seed_image,none", "seed_all,none"],
    "chartqa": ["relaxed_overall,none"],
    "mmmu_val": ["mmmu_acc,none"],
    "mmlu_abstract_algebra": ["acc,none"],
}
CHAT_TASKS = {"mmmu_val": ["mmmu_acc,none"], "mme": ["mme_perception_score,none"]}
LIMIT = 2


# ----- data with each data set's schema -----
def _png(seed: int, text: str = "") -> dict:
    """A small PIL drawing (coloured shapes + text) as the datasets Image encoding."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (48, 40), ((37 * seed) % 256, (91 * seed) % 256, (53 * seed + 80) % 256))
    draw = ImageDraw.Draw(img)
    draw.rectangle([4 + seed % 7, 6, 30, 24 + seed % 9], fill=(255, 255, 255), outline=(0, 0, 0))
    draw.ellipse([26, 14, 44, 34], fill=(200, 30, 30))
    if text:
        draw.text((6, 26), text, fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def _write(folder, split: str, rows: dict, features: dict) -> str:
    import datasets

    path = os.path.join(folder, f"{split}-00000-of-00001.parquet")
    datasets.Dataset.from_dict(rows, features=datasets.Features(features)).to_parquet(path)
    return path


def _stock_datasets(root) -> dict[str, tuple[str, str | None, dict]]:
    """task -> (repo id, config, {split: parquet}) of the data it reads (schemas of those data sets)."""
    from datasets import ClassLabel, Image, Sequence, Value

    S, I64 = Value("string"), Value("int64")
    out = {}

    def add(task, repo, config, split_rows, features):
        folder = os.path.join(str(root), repo.replace("/", "__"), config or "default")
        os.makedirs(folder, exist_ok=True)
        out[task] = (repo, config, {split: _write(folder, split, rows, features) for split, rows in split_rows.items()})

    add("mme", "lmms-lab-encoder/MME", None, {"test": {
        "question_id": ["count/000001.jpg"] * 2, "image": [_png(1, "2")] * 2,
        "question": ["Are there two objects in the image? Please answer yes or no.",
                     "Are there five objects in the image? Please answer yes or no."],
        "answer": ["Yes", "No"], "category": ["count"] * 2}},
        {"question_id": S, "image": Image(), "question": S, "answer": S, "category": S})
    add("pope", "lmms-lab-encoder/POPE", None, {"test": {
        "id": ["0", "1"], "question_id": ["1", "2"], "question": ["Is there a circle in the image?",
                                                                  "Is there a dog in the image?"],
        "answer": ["yes", "no"], "image_source": ["synthetic_1", "synthetic_2"],
        "image": [_png(2), _png(3)], "category": ["adversarial"] * 2}},
        {"id": S, "question_id": S, "question": S, "answer": S, "image_source": S, "image": Image(), "category": S})
    add("scienceqa_img", "lmms-lab-encoder/ScienceQA", "ScienceQA-IMG", {"test": {
        "image": [_png(4), _png(5)], "question": ["Which shape is red?", "Which colour is the box?"],
        "choices": [["the circle", "the box"], ["white", "green", "blue"]], "answer": [0, 0],
        "hint": ["Look at the picture.", ""], "task": ["closed choice"] * 2, "grade": ["grade2"] * 2,
        "subject": ["natural science"] * 2, "topic": ["colors"] * 2, "category": ["Shapes"] * 2,
        "skill": ["Identify shapes"] * 2, "lecture": [""] * 2, "solution": [""] * 2}},
        {"image": Image(), "question": S, "choices": Sequence(S), "answer": I64, "hint": S, "task": S,
         "grade": S, "subject": S, "topic": S, "category": S, "skill": S, "lecture": S, "solution": S})
    add("ai2d", "lmms-lab-encoder/ai2d", None, {"test": {
        "question": ["Which part is red?", "How many shapes are shown?"],
        "options": [["circle", "box", "line", "none"], ["1", "2", "3", "4"]], "answer": ["0", "1"],
        "image": [_png(6), _png(7)]}},
        {"question": S, "options": Sequence(S), "answer": S, "image": Image()})
    add("seedbench", "lmms-lab-encoder/SEED-Bench", None, {"test": {
        "answer": ["B", "A"], "choice_a": ["one", "red"], "choice_b": ["two", "blue"], "choice_c": ["three", "green"],
        "choice_d": ["four", "black"], "data_id": ["1.png", "2.png"], "data_type": ["image", "image"],
        "question": ["How many shapes are there?", "What colour is the circle?"], "question_id": ["101", "102"],
        "question_type_id": [3, 2], "image": [[_png(8)], [_png(9)]], "segment": [[], []]}},
        {"answer": S, "choice_a": S, "choice_b": S, "choice_c": S, "choice_d": S, "data_id": S, "data_type": S,
         "question": S, "question_id": S, "question_type_id": I64, "image": Sequence(Image()), "segment": Sequence(I64)})
    add("chartqa", "lmms-lab-encoder/ChartQA", None, {"test": {
        "type": ["human_test", "augmented_test"], "question": ["What is the highest value?", "How many bars?"],
        "answer": ["42", "3"], "image": [_png(10, "42"), _png(11, "3")]}},
        {"type": S, "question": S, "answer": S, "image": Image()})
    no_image = [None] * 2
    add("mmmu_val", "lmms-lab-encoder/MMMU", None, {"validation": {
        "id": ["validation_Art_1", "validation_Math_2"],
        "question": ["<image 1> Which shape is on the right?", "<image 1> How many corners has the box?"],
        "options": ["['circle', 'box', 'line']", "[]"], "explanation": ["", ""],
        "image_1": [_png(12), _png(13)], **{f"image_{i}": no_image for i in range(2, 8)},
        "img_type": ["['Diagrams']"] * 2, "answer": ["A", "4"], "topic_difficulty": ["Easy"] * 2,
        "question_type": ["multiple-choice", "open"], "subfield": ["Drawing", "Geometry"]}},
        {"id": S, "question": S, "options": S, "explanation": S, **{f"image_{i}": Image() for i in range(1, 8)},
         "img_type": S, "answer": S, "topic_difficulty": S, "question_type": S, "subfield": S})
    mmlu_rows = {"question": ["What is 2 + 2?", "Which is a group operation on the integers?"],
                 "subject": ["abstract_algebra"] * 2,
                 "choices": [["3", "4", "5", "6"], ["addition", "division", "square root", "none"]],
                 "answer": [1, 0]}
    add("mmlu_abstract_algebra", "hails/mmlu_no_train", "abstract_algebra", {"test": mmlu_rows, "dev": mmlu_rows},
        {"question": S, "subject": S, "choices": Sequence(S), "answer": ClassLabel(names=["A", "B", "C", "D"])})
    return out


# ----- the runs -----
def _lmms_eval_cli(ckpt, out_dir, tasks) -> list[str]:
    """The plain lmms-eval CLI, simple interface."""
    return [sys.executable, "-m", "lmms_eval", "--model", "conceptmoe_vlm",
            "--model_args", f"pretrained={ckpt},device=cpu,dtype=float32,max_new_tokens=8",
            "--tasks", ",".join(tasks), "--limit", str(LIMIT), "--batch_size", "2",
            "--output_path", str(out_dir), "--log_samples"]


def _make_eval_cli(ckpt, out_root, tasks, hf_home) -> list[str]:
    """``make eval``'s command (eval_suites.run -> lmms-eval CLI), chat interface, data via --hf-home."""
    return [sys.executable, "-m", "eval_suites.run", "--checkpoint", str(ckpt), "--tasks", ",".join(tasks),
            "--hf-home", str(hf_home), "--model-args", "interface=chat,max_new_tokens=8", "--device", "cpu",
            "--batch-size", "2", "--limit", str(LIMIT), "--out-root", str(out_root), "--name", "run", "--quiet"]


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    """Writes the data, fills a test HF_HOME's datasets cache with the documented command
    (``eval_suites.stock_data --task T --split NAME=FILES``), starts both CLI runs; yields them."""
    from eval_suites import stock_data
    from torch.distributed.elastic.utils.distributed import get_free_port

    base = tmp_path_factory.mktemp("stock")
    hf_home = base / "hf_home"
    ckpt = session_checkpoint(tmp_path_factory)
    for task, (repo, config, files) in _stock_datasets(base / "parquet").items():
        # the task's own YAML names the repository / config / splits these files stand for
        assert stock_data.task_source(task) == {"repo": repo, "config": config, "splits": list(files)}, task
        splits = [f"--split={split}={path}" for split, path in files.items()]
        assert stock_data.main(["--task", task, *splits, "--cache-dir", str(hf_home / "datasets")]) == 0
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for key in ("LMMS_EVAL_DATASETS_CACHE", "HF_DATASETS_CACHE"):  # lmms-eval reads $HF_HOME/datasets
        env.pop(key, None)
    commands = {"simple": (_lmms_eval_cli(ckpt, base / "out_simple", SIMPLE_TASKS), base / "out_simple", env),
                # HF_HOME only through --hf-home (what `make eval HF_HOME=...` passes)
                "chat": (_make_eval_cli(ckpt, base / "out_chat", CHAT_TASKS, hf_home), base / "out_chat",
                         {k: v for k, v in env.items() if k != "HF_HOME"})}
    runs = {}
    for name, (cmd, out, run_env) in commands.items():
        log_path = base / f"{name}.log"  # a file, not a pipe: an unread pipe would stall the run
        with open(log_path, "w") as log:
            runs[name] = (subprocess.Popen(cmd, cwd=str(REPO), env=dict(run_env, MASTER_PORT=str(get_free_port())),
                                           stdout=log, stderr=subprocess.STDOUT), out, log_path)
    yield runs
    for proc, _, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(run) -> tuple[dict, str, str]:
    proc, out, log_path = run
    proc.wait(timeout=600)
    log = log_path.read_text(errors="replace")
    # lmms-eval exits 0 even when a task failed to load: the results file is what counts
    assert proc.returncode == 0, log[-4000:]
    found = [p for p in glob.glob(str(out / "**" / "*_results.json"), recursive=True)
             if os.path.basename(p) != "results.json"]  # eval_suites.run's copy
    assert len(found) == 1, "lmms-eval wrote no results file:\n" + log[-4000:]
    with open(found[0]) as f:
        return json.load(f), log, os.path.dirname(found[0])


def _check_metrics(results: dict, expected: dict, label: str, log: str) -> None:
    missing = [t for t in expected if t not in results["results"]]
    assert not missing, f"tasks without results: {missing}\n" + log[-4000:]
    for task, keys in expected.items():
        metrics = results["results"][task]
        assert results["n-samples"][task]["effective"] == LIMIT, (task, results["n-samples"][task])
        for key in keys:
            assert key in metrics, (task, key, sorted(metrics))
            value = metrics[key]
            assert isinstance(value, (int, float)) and math.isfinite(value), (task, key, value)
            print(f"[{label}] {task:24s} {key:32s} {value:.4f}")


@pytest.mark.slow
def test_stock_tasks_simple_interface(stock_runs):
    results, log, folder = _finish(stock_runs["simple"])
    assert results["config"]["model_backend"].endswith("(simple)"), results["config"]["model_backend"]
    _check_metrics(results, SIMPLE_TASKS, "simple", log)
    # every generation task got text from the model (random text: scores are 0 or chance)
    _check_replies(folder, [task for task in SIMPLE_TASKS if task != "mmlu_abstract_algebra"])
    # each reported number is what the logged samples say
    for task, key in (("scienceqa_img", "exact_match"), ("chartqa", "relaxed_overall")):
        rows = _samples(folder, task)
        assert results["results"][task][f"{key},none"] == pytest.approx(sum(r[key] for r in rows) / LIMIT), task
    # the multiple-choice task went through loglikelihood: one (loss, greedy) pair per choice, argmin wins
    rows = _samples(folder, "mmlu_abstract_algebra")
    for row in rows:
        losses = [float(resp[0]) for resp in row["filtered_resps"]]
        assert len(losses) == 4 and all(x > 0 for x in losses), row["filtered_resps"]
        assert row["acc"] == float(losses.index(min(losses)) == int(row["target"])), (losses, row["target"])
    assert results["results"]["mmlu_abstract_algebra"]["acc,none"] == pytest.approx(sum(r["acc"] for r in rows) / LIMIT)
    assert results["results"]["mme"]["mme_perception_score,none"] in (0.0, 50.0, 200.0)  # one question pair


def _samples(folder, task) -> list[dict]:
    files = glob.glob(os.path.join(folder, f"*_samples_{task}.jsonl"))
    assert len(files) == 1, (task, files)
    with open(files[0]) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_replies(folder, tasks) -> None:
    """Every sample of each generation task holds non-empty text from the model."""
    for task in tasks:
        replies = [_reply(row) for row in _samples(folder, task)]
        assert len(replies) == LIMIT and all(isinstance(r, str) and r.strip() for r in replies), (task, replies)


def _reply(row):
    reply = row["filtered_resps"]
    while isinstance(reply, list):
        reply = reply[0]
    return reply


@pytest.mark.slow
def test_stock_tasks_chat_interface(stock_runs):
    results, log, folder = _finish(stock_runs["chat"])
    # lmms-eval built message tasks (ConfigurableMessagesTask) for a model with is_simple False
    assert results["config"]["model_backend"].endswith("(chat)"), results["config"]["model_backend"]
    _check_metrics(results, CHAT_TASKS, "chat", log)
    _check_replies(folder, CHAT_TASKS)


# ----- the chat interface's message conversion (no lmms-eval run) -----
def test_chat_messages_give_the_simple_interface_prompt():
    from PIL import Image

    from eval_suites.lmms_inputs import build_prompt, messages_to_conversation

    img = Image.new("RGB", (8, 8))
    # lmms-eval's default doc_to_messages: [images..., text] in one user turn
    conv, images = messages_to_conversation([{"role": "user", "content": [
        {"type": "image", "url": img}, {"type": "text", "text": "What digit is this? "}]}])
    assert conv == [{"role": "user", "content": build_prompt("What digit is this?", 1)}] and images == [img]
    # MMMU's interleaved messages keep the image where it was; a system message joins the user turn
    conv, images = messages_to_conversation([
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "url": img},
                                     {"type": "image", "url": img}, {"type": "text", "text": "Which?"}]}])
    assert conv == [{"role": "user", "content": "Be brief.\nLook:\n<image>\n<image>\nWhich?"}] and len(images) == 2
    with pytest.raises(NotImplementedError, match="images only"):
        messages_to_conversation([{"role": "user", "content": [{"type": "video", "url": "a.mp4"}]}])
    with pytest.raises(ValueError, match="placeholders"):
        messages_to_conversation([{"role": "user", "content": [{"type": "text", "text": "<image> x"}]}])
    with pytest.raises(ValueError, match="end with a user turn"):
        messages_to_conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])


def test_stock_data_cli_errors_are_one_line(tmp_path, capsys):
    from eval_suites.stock_data import main

    assert main(["--repo", "lmms-lab-encoder/MME", "--split", f"test={tmp_path}/none-*.parquet",
                 "--cache-dir", str(tmp_path / "c")]) == 2
    assert main(["--task", "mme", "--split", f"validation={tmp_path}/x.parquet"]) == 2  # mme reads test
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    assert "no file matches" in err[0] and "missing: ['test']" in err[1]


def test_make_eval_names_a_dataset_missing_from_the_cache():
    """lmms-eval exits 0 when a stock task's data is not cached; eval_suites.run says which."""
    from eval_suites.run import failure_reason

    log = ("    raise ConnectionError(f\"Couldn't reach '{path}' on the Hub ({e.__class__.__name__})\") from e\n"
           "ConnectionError: Couldn't reach 'lmms-lab-encoder/ChartQA' on the Hub (OfflineModeIsEnabled)\n"
           "ERROR | Error during evaluation: RetryError[<Future state=finished raised ConnectionError>].\n")
    reason = failure_reason(log, "/data/hf_home")
    assert reason.startswith("dataset lmms-lab-encoder/ChartQA is not in the offline datasets cache "
                             "(HF_HOME=/data/hf_home)") and "eval_suites.stock_data --task" in reason
