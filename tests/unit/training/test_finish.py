"""After training (vlm/training/callbacks/end_of_run.py) and a fresh run in the same folder: the export's vision
load line names the trained weights it really holds (with their checksum), and a fresh run sets the
earlier run's export aside (hf.previous) with one line instead of replacing it."""
from __future__ import annotations

import logging

import _train_helpers as helpers

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
