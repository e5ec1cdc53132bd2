"""Evaluation on CPU follows the trainer's thread policy (``apply_cpu_threads``): ``make eval`` /
``eval_suites.run`` pass ``cpu_threads`` (default 1) to the lmms-eval model, which sets torch's
threads and says so in one line; ``eval_suites.text_eval`` does the same."""
from __future__ import annotations

import os

import pytest
import torch

from _data_helpers import tiny_tokenizer
from _eval_helpers import build_tiny_vlm, make_tiny_checkpoint
from vlm.config.threads import apply_cpu_threads


@pytest.fixture(autouse=True)
def keep_threads():
    """Torch's thread count is process-wide: every test here leaves it as it found it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok"))
    tiny_tokenizer(out)
    return out


def test_policy_given_then_omp_then_cores(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert apply_cpu_threads(2) == "cpu threads: 2 (cpu_threads=2)" and torch.get_num_threads() == 2
    assert apply_cpu_threads(None, processes=cores) == f"cpu threads: 1 ({cores} cores / {cores} processes)"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch took from OMP_NUM_THREADS at start-up: left alone
    assert apply_cpu_threads(None) == "cpu threads: 3 (OMP_NUM_THREADS=3)" and torch.get_num_threads() == 3


def test_lmms_plugin_sets_and_logs_cpu_threads(tokenizer_dir, capsys):
    pytest.importorskip("lmms_eval")
    from transformers import AutoTokenizer

    from eval_suites.lmms_plugin import ConceptMoEVLMEval

    model, processor = build_tiny_vlm(AutoTokenizer.from_pretrained(tokenizer_dir))
    torch.set_num_threads(2)
    capsys.readouterr()
    ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu", cpu_threads="1")
    assert torch.get_num_threads() == 1
    assert "[conceptmoe_vlm] cpu threads: 1 (cpu_threads=1)" in capsys.readouterr().out.splitlines()
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer or auto"):
        ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu", cpu_threads="0")


def test_eval_run_passes_cpu_threads_to_the_model(capsys):
    from eval_suites.run import lmms_eval_command, parse_args

    def model_args(*flags):
        cmd = lmms_eval_command(parse_args(["--checkpoint", "ckpt", *flags]), "out")
        return cmd[cmd.index("--model_args") + 1].split(",")

    assert "cpu_threads=1" in model_args()  # make eval's default, as the default training config's
    assert "cpu_threads=4" in model_args("--cpu-threads", "4")
    assert "cpu_threads=auto" in model_args("--cpu-threads", "auto")
    with pytest.raises(SystemExit) as err:
        parse_args(["--checkpoint", "ckpt", "--cpu-threads", "-1"])
    assert err.value.code == 2 and "--cpu-threads must be a positive integer or auto" in capsys.readouterr().err


def test_text_eval_sets_and_logs_cpu_threads(tokenizer_dir, tmp_path, capsys):
    from eval_suites.text_eval import main

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", tokenizer_dir)
    text = tmp_path / "held_out.txt"
    text.write_text("What digit is this? Is it even or odd?\n" * 4, encoding="utf-8")
    torch.set_num_threads(2)
    assert main(["--checkpoint", ckpt, "--text", str(text), "--seq-len", "16", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 1
    assert "[text_eval] cpu threads: 1 (cpu_threads=1)" in capsys.readouterr().out.splitlines()


def test_lmms_plugin_defaults_are_make_evals(tokenizer_dir, capsys, monkeypatch):
    """Without cpu_threads / batch_size the model runs as make eval does (1 thread, batch 8), not at all
    cores and batch 1 (the same scores, 4x to 50x slower on 2 cores)."""
    pytest.importorskip("lmms_eval")
    from transformers import AutoTokenizer

    from eval_suites.lmms_plugin import ConceptMoEVLMEval
    from eval_suites.run import parse_args

    make_eval = parse_args(["--checkpoint", "ckpt"])
    assert (make_eval.batch_size, make_eval.cpu_threads) == (8, 1)
    model, processor = build_tiny_vlm(AutoTokenizer.from_pretrained(tokenizer_dir))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    capsys.readouterr()
    lm = ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu")
    assert torch.get_num_threads() == make_eval.cpu_threads and lm.batch_size == make_eval.batch_size
    assert "[conceptmoe_vlm] cpu threads: 1 (cpu_threads=1)" in capsys.readouterr().out.splitlines()


def _lmms_eval_commands(path):
    """The ``python -m lmms_eval`` commands of the markdown file's code blocks, continuation lines joined."""
    import shlex

    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    return [shlex.split(line.split("#")[0]) for line in text.splitlines() if " -m lmms_eval " in line]


def test_documented_lmms_eval_commands_pass_a_batch_size():
    """lmms-eval's CLI passes its own --batch_size (1 unless given) over the model's default: every direct
    command in the docs gives one, as large as make eval's."""
    from eval_suites.common import REPO_ROOT
    from eval_suites.run import parse_args

    make_eval = parse_args(["--checkpoint", "ckpt"]).batch_size
    docs = [REPO_ROOT / "README.md", REPO_ROOT / "eval_suites" / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    commands = [(str(path.relative_to(REPO_ROOT)), cmd) for path in docs for cmd in _lmms_eval_commands(path)]
    assert {"docs/evaluation.md", "eval_suites/README.md"} <= {where for where, _ in commands}
    for where, cmd in commands:
        assert "--batch_size" in cmd and int(cmd[cmd.index("--batch_size") + 1]) >= make_eval, (where, cmd)


def test_text_eval_says_when_the_model_never_saw_text(tokenizer_dir, tmp_path, capsys):
    """The default VLM run trains on digits VQA only: text_eval's perplexity is then that of a language model
    that never saw plain text, and the output says so in one line (and the JSON); a run with a text corpus,
    a pretrained LLM, or no train_config.json beside the export gets no such line."""
    import json

    from eval_suites.text_eval import main

    ckpt = make_tiny_checkpoint(tmp_path / "hf", tokenizer_dir)
    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 4, encoding="utf-8")
    run_config = tmp_path / "train_config.json"
    digits = {"name": "digits_train", "type": "llava_json", "path": "digits_train.json"}
    shakespeare = {"name": "shakespeare_train", "type": "text", "path": "shakespeare_train.txt"}

    def write(model=None, **data):
        run_config.write_text(json.dumps({"model": {"kind": "vlm", **(model or {})}, "data": data}))

    write(kind="mixture", datasets=[digits])
    capsys.readouterr()
    assert main(["--checkpoint", ckpt, "--text", str(text), "--seq-len", "16", "--device", "cpu",
                 "--json", str(tmp_path / "r.json")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "trained on no text-only corpus (digits_train (llava_json)" in notes[0], notes
    assert "never saw plain text" in notes[0] and str(run_config) in notes[0]
    assert json.loads((tmp_path / "r.json").read_text())["note"] == notes[0]
    from eval_suites.text_eval import untrained_on_text_note

    write(kind="synthetic")
    assert "synthetic tokens only" in untrained_on_text_note(ckpt)
    write(kind="mixture", datasets=[digits, shakespeare])
    assert untrained_on_text_note(ckpt) is None
    write(kind="mixture", config="configs/data/default.yaml", datasets=None)  # its mixture has Shakespeare
    assert untrained_on_text_note(ckpt) is None
    write({"llm": "some/pretrained-llm"}, kind="mixture", datasets=[digits])
    assert untrained_on_text_note(ckpt) is None
    run_config.unlink()  # no train_config.json: nothing is claimed
    assert untrained_on_text_note(ckpt) is None
