"""Test fixtures for the evaluation tests (tests/*/eval_suites/test_eval_*.py): tiny random ConceptMoE-VL checkpoints
and the task data, made once per pytest session."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_VLM_PRESET = REPO / "configs" / "model" / "vlm_tiny.yaml"


def tokenizer_token_ids(tokenizer) -> dict:
    """The model-config token fields (vocabulary size, text and image ids) the trainer takes from it."""
    from vlm.training.build import token_ids

    text_ids, image_ids = token_ids(tokenizer)
    return {**text_ids, **image_ids}


def build_tiny_vlm(tokenizer, seed: int = 0, preset: str | os.PathLike = TINY_VLM_PRESET):
    """(model, processor): a seeded random tiny VLM in eval mode and its processor."""
    import torch

    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor
    from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig

    config = ConceptMoEVLMConfig.from_yaml(preset, **tokenizer_token_ids(tokenizer))
    torch.manual_seed(seed)
    model = ConceptMoEVLMForConditionalGeneration(config).float().eval()
    processor = ConceptMoEVLMProcessor.for_model(tokenizer, model)
    return model, processor


def make_tiny_checkpoint(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, seed: int = 0) -> str:
    """An HF export like the trainer's ``runs/<name>/hf/`` (model + processor files) of a seeded
    ``vlm_tiny.yaml`` model sized to the tokenizer. Idempotent (a ``.complete`` stamp)."""
    out_dir = str(out_dir)
    stamp = os.path.join(out_dir, ".complete")
    if os.path.isfile(stamp):
        return out_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model, processor = build_tiny_vlm(tokenizer, seed)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    with open(stamp, "w") as f:
        f.write("ok\n")
    return out_dir


def tiny_export(root: str | os.PathLike, seed: int = 0) -> str:
    """``make_tiny_checkpoint`` at ``root/export`` with the tiny tokenizer built at ``root/tok``."""
    from _data_helpers import tiny_tokenizer

    root = Path(root)
    tiny_tokenizer(str(root / "tok"))
    return make_tiny_checkpoint(root / "export", root / "tok", seed)


# ----- made once per pytest session, under its base temp dir -----
def default_data_dir(tmp_path_factory) -> str:
    """The repo's built ``data/default`` (``make test`` builds it first), else a session-built copy."""
    repo_data = REPO / "data" / "default"
    if (repo_data / ".built").is_file() and (repo_data / "tokenizer").is_dir():
        return str(repo_data)
    from _data_helpers import session_default_data

    return session_default_data(tmp_path_factory)


def session_checkpoint(tmp_path_factory) -> str:
    """A tiny random checkpoint, made once per pytest session."""
    data = default_data_dir(tmp_path_factory)
    return make_tiny_checkpoint(tmp_path_factory.getbasetemp() / "cmoe_tiny_vlm", os.path.join(data, "tokenizer"))


def session_eval_data(tmp_path_factory) -> str:
    """The task parquet files, built once per pytest session (never into the repo's data folder)."""
    from eval_suites.build_tasks import build

    data = default_data_dir(tmp_path_factory)
    out = str(tmp_path_factory.getbasetemp() / "cmoe_eval_data")
    build(data, out, quiet=True)
    return out


def train_tiny_vlm(tokenizer, conversations, steps: int = 150, seed: int = 0, lr: float = 3e-3,
                   batch_size: int = 16):
    """(model, processor): ``build_tiny_vlm`` trained in this process on text-only conversations,
    each encoded by the training encoder (``ChatTokenizer.encode_conversation``: loss on the
    assistant reply + its turn end), so the model has learnt their answers in the training format.
    About 6 s for 30 short conversations on one CPU core."""
    import torch

    from vlm.modeling.padding import pad_token_lists
    from vlm.modeling.chat_common import IGNORE_INDEX

    model, processor = build_tiny_vlm(tokenizer, seed)
    chat = processor.chat_tokenizer
    encoded = [chat.encode_conversation(conv, sample_id=i) for i, conv in enumerate(conversations)]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        pick = torch.randperm(len(encoded), generator=generator)[:batch_size].tolist()
        input_ids, mask = pad_token_lists([encoded[i][0] for i in pick], chat.pad_id, "right")
        labels, _ = pad_token_lists([encoded[i][1] for i in pick], IGNORE_INDEX, "right")
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), processor
