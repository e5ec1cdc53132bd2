"""loglikelihood scores a continuation as the assistant's reply, whatever the task's target_delimiter.

A tiny VLM is trained here (``train_tiny_vlm``, a few seconds) on 30 text questions with
multi-token answers ("odd", "seven", "10"), encoded the way training encodes them. lmms-eval's own
evaluator then runs the same questions as a generate_until task and as multiple_choice tasks with
the default ``target_delimiter`` (" ") and with "": the choices must score identically, and
multiple-choice accuracy must match generation accuracy. Before the fix, " " made the model score
" seven" (tokens 'Ġse', 'ven', never seen after the generation prompt) and the words / plus-one
questions fell to chance or below.
"""
from __future__ import annotations

import os

import pytest
import yaml

pytest.importorskip("lmms_eval")

from vlm.modeling.chat_template import ChatTokenizer
from vlm.modeling.chat_common import IGNORE_INDEX
from eval_suites import lmms_plugin
from _eval_helpers import build_tiny_vlm, default_data_dir, train_tiny_vlm

WORDS = "zero one two three four five six seven eight nine".split()
PARITY = ["even", "odd"]
PLUS_ONE = [str(n) for n in range(1, 11)]
# |multiple-choice accuracy - generation accuracy| allowed: greedy decoding and ranking a fixed
# list of choices can disagree on a question the model is unsure of (3 of the 30 questions)
MARGIN = 0.1


def questions() -> list[dict]:
    """30 questions with multi-token answers and their choices (label = index of the answer)."""
    docs = []
    for d in range(10):
        for question, answer, choices in ((f"Is {d} even or odd?", PARITY[d % 2], PARITY),
                                          (f"What is {d} in words?", WORDS[d], WORDS),
                                          (f"What is {d} plus one?", str(d + 1), PLUS_ONE)):
            docs.append({"question": question, "answer": answer, "choices": choices,
                         "label": choices.index(answer)})
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(default_data_dir(tmp_path_factory), "tokenizer"))


@pytest.fixture(scope="module")
def trained(tokenizer):
    convs = [[{"from": "human", "value": q["question"]}, {"from": "gpt", "value": q["answer"]}]
             for q in questions()]
    return train_tiny_vlm(tokenizer, convs, steps=150, seed=0)


def _labelled(chat: ChatTokenizer, question: str, reply: str) -> tuple[list[int], list[int]]:
    """(ids, labelled ids) of the training encoding of one question and its reply."""
    ids, labels = chat.encode_conversation([{"from": "human", "value": question},
                                            {"from": "gpt", "value": reply}])
    return ids, [tok for tok, lab in zip(ids, labels) if lab != IGNORE_INDEX]


def _check_scored_ids(plugin, replies):
    chat = plugin.chat
    for reply in replies:
        ids, labelled = _labelled(chat, "What is 7 in words?", reply)
        assert labelled[-1] == chat.end_id
        prompt = chat.encode_prompt("What is 7 in words?")
        # the training sequence is the generation prompt, then the labelled reply + turn end
        assert ids[:len(prompt) + len(labelled)] == prompt + labelled
        for delimiter in ("", " ", "\n", "  "):
            assert plugin.continuation_ids(delimiter + reply) == labelled, (delimiter, reply)
            row, scored = plugin.encode_request("What is 7 in words? ", delimiter + reply, [])
            assert (row, scored) == (prompt + labelled, len(labelled))
        plugin.score_end_token = False
        try:
            assert plugin.continuation_ids(" " + reply) == labelled[:-1]
        finally:
            plugin.score_end_token = True


def test_scored_ids_are_the_training_reply_tokens(tokenizer):
    model, processor = build_tiny_vlm(tokenizer, seed=0)
    plugin = lmms_plugin.ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu")
    assert plugin.tok_encode(" seven") != plugin.tok_encode("seven")  # the delimiter changes tokens
    _check_scored_ids(plugin, ["seven", "odd", "even", "10", "3", "A small gray square."])


def test_scores_are_the_log_softmax_at_t_minus_1(tokenizer):
    """Each score is -sum over the scored ids t of log softmax(logits[t - 1])[id_t], computed here by hand
    from one unpadded forward of the same row (with an image on one of them); is_greedy is argmax at t - 1."""
    import torch
    from PIL import Image

    model, processor = build_tiny_vlm(tokenizer, seed=1)
    plugin = lmms_plugin.ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu", batch_size=3)
    image = Image.new("RGB", (32, 32), (200, 30, 90))
    items = [("What is 7 in words?", " seven", []), ("Is 3 even or odd?", "odd", []),
             ("What is in the picture?", "A small gray square.", [image])]
    for (context, continuation, images), (nll, greedy) in zip(items, plugin.score_batch(items)):
        row, n = plugin.encode_request(context, continuation, images)
        ids = torch.tensor([row])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=plugin._pixel_values(images),
                           attention_mask=torch.ones_like(ids)).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        scored = range(len(row) - n, len(row))
        by_hand = -sum(float(logprobs[t - 1, row[t]]) for t in scored)
        assert nll == pytest.approx(by_hand, rel=1e-5, abs=1e-5), continuation
        assert greedy == all(int(logits[t - 1].argmax()) == row[t] for t in scored)


@pytest.mark.parametrize("flavour", ["chatml", "llama3"])
def test_scored_ids_follow_a_pretrained_chat_template(tmp_path, flavour):
    """Same rule with an LLM's own template: the reply, then its stop token (<|im_end|>, <|eot_id|>)."""
    from transformers import AutoTokenizer

    from data_pipelines.llm_tokenizer import prepare_llm_tokenizer
    from test_llm_tokenizer import FLAVOURS, llm_tokenizer_folder

    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), flavour))
    prepare_llm_tokenizer(tokenizer)
    model, processor = build_tiny_vlm(tokenizer, seed=0)
    plugin = lmms_plugin.ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu")
    assert plugin.chat.use_model_template
    assert plugin.chat.end_id == tokenizer.convert_tokens_to_ids(FLAVOURS[flavour][3])
    _check_scored_ids(plugin, ["seven", "odd", "10", "A small gray square."])


def _write_tasks(root, docs) -> None:
    import datasets

    data = os.path.join(root, "toy_qa.parquet")
    datasets.Dataset.from_list(docs).to_parquet(data)
    common = {"dataset_path": "parquet", "dataset_kwargs": {"data_files": {"test": data}},
              "test_split": "test", "doc_to_text": "question", "metadata": {"version": 1.0}}
    mc = {**common, "output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "label",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    tasks = {"toy_mc_default": mc,  # lmms-eval's default target_delimiter: " "
             "toy_mc_nodelim": {**mc, "target_delimiter": ""},
             "toy_gen": {**common, "output_type": "generate_until", "doc_to_target": "answer",
                         "generation_kwargs": {"max_new_tokens": 4, "temperature": 0, "do_sample": False,
                                               "until": ["<|end|>"]},
                         "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                                          "higher_is_better": True}]}}
    for name, cfg in tasks.items():
        with open(os.path.join(root, f"{name}.yaml"), "w") as f:
            yaml.safe_dump({"task": name, **cfg}, f, sort_keys=False)


def test_multiple_choice_matches_generation_whatever_the_delimiter(trained, tmp_path, monkeypatch):
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    docs = questions()
    _write_tasks(str(tmp_path), docs)
    monkeypatch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))
    # batch_size=1: no padding, so equal token rows give bit-identical scores (batched scores differ
    # from single ones by float rounding only: test_eval_lmms.py::test_batched_scores_match_one_by_one)
    plugin = lmms_plugin.ConceptMoEVLMEval(pretrained=trained[0], processor=trained[1], device="cpu",
                                           batch_size=1)
    seen = {}  # (task, doc_id, choice index) -> (continuation lmms-eval built, score)
    score = plugin.loglikelihood

    def recording(requests):
        results = score(requests)
        for req, result in zip(requests, results):
            seen[(req.task_name, req.doc_id, req.idx)] = (req.args[1], result)
        return results

    plugin.loglikelihood = recording
    out = simple_evaluate(model=plugin, tasks=["toy_mc_default", "toy_mc_nodelim", "toy_gen"],
                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                          process_docs_parallel=1)
    results = out["results"]
    gen = results["toy_gen"]["exact_match,none"]
    acc_default, acc_nodelim = results["toy_mc_default"]["acc,none"], results["toy_mc_nodelim"]["acc,none"]
    print(f"generation {gen:.3f}  MC (' ') {acc_default:.3f}  MC ('') {acc_nodelim:.3f}")
    assert gen >= 0.9  # the model answers its questions
    assert abs(acc_default - gen) <= MARGIN

    # lmms-eval put the delimiter in front of every choice, and the scores ignore it
    assert len(seen) == 2 * sum(len(doc["choices"]) for doc in docs)
    for doc_id, doc in enumerate(docs):
        for i, choice in enumerate(doc["choices"]):
            spaced, score_spaced = seen[("toy_mc_default", doc_id, i)]
            plain, score_plain = seen[("toy_mc_nodelim", doc_id, i)]
            assert (spaced, plain) == (" " + choice, choice)
            assert score_spaced == score_plain  # identical log-likelihoods
    assert acc_default == acc_nodelim
