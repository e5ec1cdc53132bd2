"""After training (vlm/training/callbacks/end_of_run.py) and a fresh run in the same folder: the export's vision
load line names the trained weights it really holds (with their checksum); a fresh run that exports sets the
earlier run's export aside (hf.previous) only once its own is complete, one that does not at its start."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import _train_helpers as helpers
import pytest

from vlm.modeling.vision_hub import weights_digest


def _vision_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vision_encoders"]


def test_export_logs_the_trained_vision_weights_and_a_fresh_run_sets_it_aside(tmp_path, caplog, capsys):
    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration

    raw = helpers.config(tmp_path, base=helpers.TINY_VLM, name="run", train={"max_steps": 2},
                         checkpoint={"every_steps": 0, "export_hf": True})
    caplog.set_level(logging.INFO, logger="vision_encoders")
    trainer = helpers.run_inprocess(raw, tmp_path)
    caplog.clear()
    trainer.finish()
    lines = _vision_lines(caplog)
    hf = tmp_path / "run" / "hf"
    exported = ConceptMoEVLMForConditionalGeneration.from_pretrained(str(hf))
    count, digest = weights_digest(exported.vision)
    assert lines == [f"vision: timm 'vit_tiny_patch16_224' <- the weights trained in run run: {count} tensors, "
                     f"{digest}"], lines  # no "random init" line of the fresh copy the export builds
    fresh = ConceptMoEVLMForConditionalGeneration(exported.config).vision
    assert weights_digest(fresh)[1] != digest  # the line's checksum is not a fresh random init's

    capsys.readouterr()
    first = (hf / "model.safetensors").read_bytes()
    helpers.run_inprocess({**raw, "checkpoint": {**raw["checkpoint"], "export_hf": False}}, tmp_path)
    out = capsys.readouterr().out
    prev = tmp_path / "run" / "hf.previous"
    assert f"[train] fresh start: moved the earlier run's Hugging Face export to {prev}" in out.splitlines(), out
    assert not hf.exists() and (prev / "model.safetensors").read_bytes() == first


def test_summary_times_after_a_resume_name_this_process_and_all_steps():
    """Issue 33: a resumed run printed `train time 310.9 s` (all steps, the earlier run's included) above
    `wall time 206.2 s` (this process). The rows say which is which, and this process's train time
    is the part of its wall time that trained."""
    from vlm.training.callbacks.end_of_run import summary_table
    from vlm.training.state import Progress

    progress = Progress(step=1000, tokens_seen=10_000, train_time_s=310.9)
    table = summary_table("r", progress, "1 FLOP/s", 206.2, None, resumed_at=(500, 160.4))
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()
            if line.startswith("| ")}
    assert rows["train time, this process (steps 501-1000)"] == "150.5 s"
    assert rows["train time, steps 1-1000 (incl. before the resume)"] == "310.9 s"
    assert rows["wall time, this process (startup, train, export, eval)"] == "206.2 s"
    fresh = summary_table("r", progress, "1 FLOP/s", 400.0, None)
    assert "| train time (steps 1-1000) " in fresh and "| wall time (startup, train, export, eval) " in fresh


def test_a_resumed_run_says_so_before_the_init_lines(tmp_path, capsys):
    """The resumed run logged `random init ... 44 tensors` before `resumed from`, which read as lost
    weights: the resume is named first, with what happens to the init; the summary's own train time
    (steps 3-3) is within this process's wall time."""
    raw = helpers.config(tmp_path, name="res", train={"max_steps": 2}, checkpoint={"every_steps": 2})
    helpers.run_inprocess(raw, tmp_path)
    capsys.readouterr()
    helpers.run_inprocess({**raw, "train": {**raw["train"], "max_steps": 3}}, tmp_path, resume="auto", finish=True)
    lines = capsys.readouterr().out.splitlines()
    ckpt = tmp_path / "res" / "ckpt" / "step_000002"
    first = next(i for i, line in enumerate(lines) if line.startswith("[train] resuming from "))
    init = next(i for i, line in enumerate(lines) if "random init" in line)
    assert first < init, lines
    assert lines[first] == (f"[train] resuming from {ckpt}: the model is built with the initial weights logged "
                            "below, then every weight is replaced by the checkpoint's")
    rows = {line.split("|")[1].strip(): float(line.split("|")[2].split()[0]) for line in lines
            if line.startswith("| ") and " time" in line}
    own, wall = rows["train time, this process (steps 3-3)"], rows["wall time, this process (startup, train, export, eval)"]
    # the table rounds to 0.1 s (a one-step train time can print 0.0): positivity is checked on summary.json below
    assert 0 <= own <= wall and own <= rows["train time, steps 1-3 (incl. before the resume)"], rows
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert summary["resumed_at_step"] == 2
    from vlm.training.peak import cpu_model

    assert summary["machine"]["cpu"] == cpu_model()  # README's figure names it (scripts/readme_figures.py)
    assert 0 < summary["train_time_this_process_s"] < summary["train_time_s"], summary


def test_a_rerun_keeps_the_earlier_export_until_its_own_is_complete(tmp_path, capsys, monkeypatch):
    """Issue 39: rerunning `make train-vlm` moved runs/train-vlm/hf aside at its start, so an interrupted
    rerun left `make eval CKPT=runs/train-vlm/hf` with nothing. The earlier export stays loadable while
    the rerun trains and while its export is written (a failure halfway leaves it as it was); the new one
    replaces it only once complete, and the earlier one is then hf.previous."""
    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration

    raw = helpers.config(tmp_path, base=helpers.TINY_VLM, name="run", train={"max_steps": 1},
                         checkpoint={"every_steps": 0, "export_hf": True})
    helpers.run_inprocess(raw, tmp_path, finish=True)
    hf, prev = tmp_path / "run" / "hf", tmp_path / "run" / "hf.previous"
    first = (hf / "model.safetensors").read_bytes()

    rerun = helpers.run_inprocess({**raw, "seed": 1}, tmp_path)  # trained, not finished: the interrupted rerun
    assert (hf / "model.safetensors").read_bytes() == first and not prev.exists()
    ConceptMoEVLMForConditionalGeneration.from_pretrained(str(hf))

    def fail_halfway(self, path, *args, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{")  # a partial folder: then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ConceptMoEVLMForConditionalGeneration, "save_pretrained", fail_halfway)
    with pytest.raises(OSError, match="No space left"):
        rerun.finish()
    assert (hf / "model.safetensors").read_bytes() == first and not prev.exists()
    ConceptMoEVLMForConditionalGeneration.from_pretrained(str(hf))
    monkeypatch.undo()

    capsys.readouterr()
    rerun.finish()
    assert (prev / "model.safetensors").read_bytes() == first
    assert (hf / "model.safetensors").read_bytes() != first  # seed 1's weights
    ConceptMoEVLMForConditionalGeneration.from_pretrained(str(hf))
    assert f"[train] exported Hugging Face model to {hf} (the earlier export is now {prev})" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("hf")) == ["hf", "hf.previous"]
