"""Held-out digits VQA accuracy (greedy generation, exact match) and the achieved compression ratio
on the prompts."""
from __future__ import annotations

import json
import os
from collections import Counter

import torch

from vlm.modeling.chunking import achieved_ratio, concept_counts


MISSING = "(none)"  # the breakdown key of records that lack the field (when others have it)


def _group(record: dict, field: str | None) -> str | None:
    """The breakdown key of a record: the value of its ``field`` (``MISSING`` when absent), or None
    when there is no breakdown."""
    if not field:
        return None
    value = record.get(field)
    return MISSING if value is None else str(value)


def _question_answer(record: dict) -> tuple[str, str]:
    turns = record["conversations"]
    question = next(t["value"] for t in turns if t.get("from", t.get("role")) in ("human", "user"))
    answer = next(t["value"] for t in turns if t.get("from", t.get("role")) in ("gpt", "assistant"))
    return question, answer


@torch.no_grad()
def digits_vqa_accuracy(model, processor, json_path, image_root, limit: int | None = 300, batch_size: int = 64,
                        max_new_tokens: int = 4, num_examples: int = 5, breakdown_by: str | None = None) -> dict:
    """Accuracy on a LLaVA JSON split: reads it
    (``data/default/digits_test.json``: one image and one question per record, answer = the gpt
    turn), takes the first ``limit`` records in file order (the file interleaves the three question
    kinds: digit, parity, plus one), builds left-padded generation prompts with the processor,
    generates greedily up to ``max_new_tokens`` tokens (stopping at ``<|end|>``), and counts a hit when
    the decoded reply, stripped of whitespace, equals the answer exactly. It also runs one forward
    pass over each prompt batch in eval mode (hard boundaries ``p >= 0.5``) to report the achieved
    compression ratio R = tokens / concepts, pooled and per modality (image / text tokens).

    ``breakdown_by``: a record field (the default data's ``kind``: digit / parity / plus_one); the
    accuracy per value of it goes to ``by_kind`` (empty when None, and when no scored record has the
    field: ``breakdown_missing`` is then True). Records without it, among others with it, form ``MISSING``.

    Returns ``{"accuracy", "correct", "total", "breakdown_by", "by_kind": {value: accuracy}, "ratio", "ratio_image",
    "ratio_text", "examples": [first few (question, answer, prediction)]}``. Chance level: 10% for
    "What digit is this?", 50% for parity.
    """
    from vlm.modeling.image_transform import load_image

    with open(json_path, encoding="utf-8") as f:
        records = json.load(f)
    if limit:
        records = records[:limit]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    chat = processor.chat_tokenizer
    end_id = chat.end_id
    image_id = chat.image_id
    hits, totals = Counter(), Counter()
    n_total = n_correct = 0
    tok = {"all": 0, "img": 0, "txt": 0}
    bnd = {"all": 0, "img": 0, "txt": 0}
    examples = []
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start:start + batch_size]
            prompts, images, answers = [], [], []
            for rec in chunk:
                question, answer = _question_answer(rec)
                prompts.append(question)
                answers.append(answer.strip())
                if rec.get("image"):
                    img = load_image(os.path.join(image_root, rec["image"]))
                    if not hasattr(img, "size"):  # a Skip: missing / corrupt image
                        raise FileNotFoundError(f"{rec['image']}: {getattr(img, 'reason', img)}")
                    images.append(img)
            enc = processor(text=prompts, images=images or None, padding_side="left")
            ids = enc["input_ids"].to(device)
            mask = enc["attention_mask"].to(device)
            pix = enc["pixel_values"].to(device) if enc["pixel_values"] is not None else None
            out = model(input_ids=ids, pixel_values=pix, attention_mask=mask)
            if getattr(out, "boundary_mask", None) is not None:
                img = ids == image_id if image_id is not None else torch.zeros_like(mask, dtype=torch.bool)
                n = concept_counts(out.boundary_mask, mask, img)
                for key, suffix in (("all", ""), ("img", "_image"), ("txt", "_text")):
                    tok[key] += int(n["tokens" + suffix].sum())
                    bnd[key] += int(n["concepts" + suffix].sum())
            gen = model.generate(input_ids=ids, pixel_values=pix, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=end_id, pad_token_id=chat.pad_id)
            new = gen[:, ids.shape[1]:].tolist()
            for rec, question, answer, row in zip(chunk, prompts, answers, new):
                if end_id in row:
                    row = row[:row.index(end_id)]
                pred = processor.decode(row, skip_special_tokens=True).strip()
                kind = _group(rec, breakdown_by)
                hit = int(pred == answer)
                n_total += 1
                n_correct += hit
                if kind is not None:
                    totals[kind] += 1
                    hits[kind] += hit
                if len(examples) < num_examples:
                    examples.append({"question": question.replace("<image>", "").strip(), "answer": answer,
                                     "prediction": pred})
    finally:
        model.train(was_training)
    total, correct = n_total, n_correct
    missing = bool(breakdown_by) and set(totals) == {MISSING}
    if missing:  # no record has the field: no breakdown (the summary says so), not a single "(none)" row
        totals.clear()
    result = {"accuracy": correct / total if total else float("nan"), "correct": correct, "total": total,
              "breakdown_by": breakdown_by, "by_kind": {k: hits[k] / totals[k] for k in sorted(totals)},
              "examples": examples}
    if missing:
        result["breakdown_missing"] = True
    for key, name in (("all", "ratio"), ("img", "ratio_image"), ("txt", "ratio_text")):
        if bnd[key]:
            result[name] = achieved_ratio(tok[key], bnd[key])
    return result
