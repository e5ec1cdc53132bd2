"""Helpers for the offline ConceptMoE-VL digit tasks (``cmoe_digits_vqa``, ``cmoe_digits_mc``).

Data files: ``$CMOE_DATA_DIR/digits_{vqa,mc}_test.parquet``. ``CMOE_DATA_DIR`` defaults to
``data/default/eval`` under the current directory when that exists, else under the repository
that holds this file. Build them with ``python -m eval_suites.build_tasks`` (``eval_suites.run``
does it for you). The YAMLs read ``VQA_DATA_FILES`` / ``MC_DATA_FILES`` through lmms-eval's
``!function`` tag, which imports a module attribute relative to the YAML; here the attribute is
the ``data_files`` mapping handed to ``datasets.load_dataset("parquet", data_files=...)``,
resolved when the task config is loaded.

Scoring honours the tasks' stop strings (``STOP_STRINGS``, the YAMLs' ``until``) on the reply itself: the
``conceptmoe_vlm`` plugin stops there already, but lmms-eval's ``openai`` model neither sends ``until``
as ``stop`` nor cuts the reply, so without this a server's answer would be scored past the stop.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_DATA_DIR = os.path.join("data", "default", "eval")
VQA_FILE = "digits_vqa_test.parquet"
MC_FILE = "digits_mc_test.parquet"


def data_dir() -> str:
    env = os.environ.get("CMOE_DATA_DIR", "").strip()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    local = os.path.abspath(DEFAULT_DATA_DIR)
    if os.path.isdir(local):
        return local
    repo = Path(__file__).resolve().parents[3]  # eval_suites/tasks/cmoe_digits/utils.py -> repo root
    return str(repo / DEFAULT_DATA_DIR)


VQA_DATA_FILES = {"test": os.path.join(data_dir(), VQA_FILE)}
MC_DATA_FILES = {"test": os.path.join(data_dir(), MC_FILE)}


# ----- shared -----
def doc_to_visual(doc):
    return [doc["image"].convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


# ----- replies: cut at the tasks' stop strings -----
STOP_STRINGS = ("<|end|>", "\n")  # = generation_kwargs.until of the generation YAMLs (a test holds them equal)


def cut_at_stops(text: str) -> str:
    """The reply up to its first stop string (the ``until`` a model may not have applied)."""
    text = str(text)
    for stop in STOP_STRINGS:
        text = text.split(stop)[0]
    return text


# ----- VQA: exact match -----
def normalize_answer(text: str) -> str:
    """Lower case, surrounding whitespace and trailing punctuation removed, inner spaces squeezed."""
    text = re.sub(r"\s+", " ", str(text).strip().lower())
    return text.rstrip(" .!?,;:")


def vqa_process_results(doc, results):
    prediction = cut_at_stops(results[0] if results else "")
    hit = float(normalize_answer(prediction) == normalize_answer(doc["answer"]))
    return {"exact_match": hit}


# ----- multiple choice -----
def mc_doc_to_choice(doc):
    return list(doc["choices"])


def mc_doc_to_target(doc):
    return int(doc["label"])


# ----- multiple choice as generation (cmoe_digits_mc_gen): models without loglikelihood -----
def mc_gen_doc_to_target(doc):
    return str(doc["choices"][int(doc["label"])])


def mc_gen_process_results(doc, results):
    """acc = the generated reply (cut at the stop strings, normalised) is the labelled choice."""
    prediction = normalize_answer(cut_at_stops(results[0] if results else ""))
    return {"acc": float(prediction == normalize_answer(mc_gen_doc_to_target(doc)))}
