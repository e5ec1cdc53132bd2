"""The lmms-eval plugin in-process: registration, the 0.7.x compat fix, loglikelihood ranking,
batched scoring / generation, and the text evaluation maths.

The ranking tests use an honest toy: a tiny random VLM whose lm_head output gets a large bias on
one digit token (a forward hook), so that digit is by construction the most likely answer.
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lmms_eval")

from eval_suites import lmms_compat, lmms_plugin
from eval_suites.lmms_inputs import build_prompt
from _eval_helpers import build_tiny_vlm, default_data_dir, session_eval_data

TASKS_DIR = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")), "eval_suites", "tasks")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return default_data_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny(data_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data_dir, "tokenizer"))
    return build_tiny_vlm(tokenizer, seed=0)


@pytest.fixture(scope="module")
def plugin(tiny):
    model, processor = tiny
    return lmms_plugin.ConceptMoEVLMEval(pretrained=model, processor=processor, device="cpu", batch_size=10)


@pytest.fixture
def favour_token(tiny):
    """Factory: add ``bias`` to one token's logit at every position (removed after the test)."""
    handles = []

    def apply(token_id: int, bias: float = 30.0):
        def hook(module, inputs, output):
            output = output.clone()
            output[..., token_id] += bias
            return output

        handles.append(tiny[0].language_model.lm_head.register_forward_hook(hook))

    yield apply
    for h in handles:
        h.remove()


def _digit_image(data_dir, index=2):
    from PIL import Image

    return Image.open(os.path.join(data_dir, "images", "digits", f"{index}.png"))


# ----- registration -----
def test_manifest_resolves_to_the_plugin_class():
    """This module imports eval_suites.lmms_plugin before lmms_eval.models, the order that made a
    module-level ModelManifest unreachable (circular import): the installed entry point must
    still have registered the model by itself, before any register() call."""
    from importlib.metadata import entry_points

    from lmms_eval import models
    from lmms_eval.models.registry_v2 import ModelManifest

    manifest = lmms_plugin.MANIFEST()
    assert isinstance(manifest, ModelManifest) and manifest.model_id == "conceptmoe_vlm"
    installed = [ep for ep in entry_points(group="lmms_eval.models") if ep.name == "conceptmoe_vlm"]
    for ep in installed:  # when installed (pip install -e .), it must point at the manifest
        assert ep.value == "eval_suites.lmms_plugin:MANIFEST"
        assert ep.load() is lmms_plugin.MANIFEST
        assert "conceptmoe_vlm" in models.MODEL_REGISTRY_V2.list_model_names()
    lmms_plugin.register()  # no-op when the entry point already registered it
    assert models.get_model("conceptmoe_vlm") is lmms_plugin.ConceptMoEVLMEval


# ----- compat fix -----
def test_compat_fix_passes_loglikelihood_pairs_and_nothing_else():
    from lmms_eval import evaluator
    from lmms_eval.api import instance

    assert lmms_compat.apply_lmms_eval_compat() == lmms_compat._mangles_pairs(
        getattr(instance.unwrap_generation_output, "__wrapped__", instance.unwrap_generation_output))
    unwrap = instance.unwrap_generation_output
    if not getattr(unwrap, "_cmoe_compat", False):
        pytest.skip("installed lmms-eval does not mangle (number, bool) results; no fix needed")
    original = unwrap.__wrapped__
    assert original((1.5, True))[0] == "(1.5, True)"  # the bug: the pair became a string
    assert unwrap((1.5, True)) == ((1.5, True), None)
    assert unwrap((3, False)) == ((3.0, False), None)
    assert unwrap("text") == ("text", None)
    text, counts = unwrap(("text", {"input_tokens": 3}))
    assert text == "text" and counts.input_tokens == 3
    assert unwrap(["a", "b"]) == (["a", "b"], None)
    assert unwrap((True, False)) == original((True, False))  # a bool is not a score
    assert evaluator.unwrap_generation_output is unwrap
    assert lmms_compat.apply_lmms_eval_compat() is True
    assert instance.unwrap_generation_output is unwrap  # idempotent: no double wrapping


def test_compat_fix_leaves_a_fixed_lmms_eval_alone(monkeypatch):
    from lmms_eval.api import instance

    def fixed(output):
        return output, None

    monkeypatch.setattr(instance, "unwrap_generation_output", fixed)
    assert lmms_compat.apply_lmms_eval_compat() is False
    assert instance.unwrap_generation_output is fixed
    monkeypatch.setattr(lmms_compat, "_lmms_eval_version", lambda: (0, 6, 1))
    monkeypatch.setattr(instance, "unwrap_generation_output", lambda o: (str(o), None))
    assert lmms_compat.apply_lmms_eval_compat() is False  # versions before 0.7 never get it


# ----- loglikelihood -----
def test_favoured_digit_has_lowest_nll_and_is_greedy(plugin, favour_token, data_dir):
    seven = plugin.tok_encode("7")
    assert len(seven) == 1
    favour_token(seven[0])
    image = _digit_image(data_dir)
    items = [("What digit is this?", str(d), [image]) for d in range(10)]
    scores = plugin.score_batch(items)
    nll = [s[0] for s in scores]
    assert min(range(10), key=nll.__getitem__) == 7
    assert all(v > 0 for v in nll)  # a loss: lmms-eval's multiple_choice takes the argmin
    # is_greedy covers <|end|> too, and the hook makes "7" (not <|end|>) greedy after "7"
    assert not any(greedy for _, greedy in scores)
    plugin.score_end_token = False
    try:
        scores = plugin.score_batch(items)
    finally:
        plugin.score_end_token = True
    assert [greedy for _, greedy in scores] == [d == 7 for d in range(10)]


def test_real_evaluator_picks_the_most_likely_choice(tiny, favour_token, tmp_path_factory, monkeypatch):
    """lmms-eval's own multiple_choice scoring (argmin, via the compat fix) on the local MC task.

    A fresh wrapper: the evaluator calls ``lm.clean()`` at the end, which drops the wrapper's
    nn.Module attributes (the model object itself lives on in ``tiny``).
    """
    import datasets
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    eval_dir = session_eval_data(tmp_path_factory)
    monkeypatch.setenv("CMOE_DATA_DIR", eval_dir)
    monkeypatch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets_cache"))
    limit = 8
    labels = datasets.load_dataset("parquet", data_files={"test": os.path.join(eval_dir, "digits_mc_test.parquet")},
                                   cache_dir=str(tmp_path_factory.getbasetemp() / "hf_datasets_cache"),
                                   split="test")["label"][:limit]
    favourite = max(set(labels), key=labels.count)
    plugin = lmms_plugin.ConceptMoEVLMEval(pretrained=tiny[0], processor=tiny[1], device="cpu", batch_size=10)
    favour_token(plugin.tok_encode(str(favourite))[0])
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    out = simple_evaluate(model=plugin, tasks=["cmoe_digits_mc"], limit=limit, task_manager=manager,
                          log_samples=True, process_docs_parallel=1)
    acc = out["results"]["cmoe_digits_mc"]["acc,none"]
    assert acc == pytest.approx(labels.count(favourite) / limit)
    resps = out["samples"]["cmoe_digits_mc"][0]["filtered_resps"]
    assert len(resps) == 10 and all(isinstance(r[0], float) for r in resps)


def test_batched_scores_match_one_by_one(plugin, data_dir):
    image_a, image_b = _digit_image(data_dir, 2), _digit_image(data_dir, 13)
    items = [("What digit is this?", "3", [image_a]), ("Is it even or odd?", "even", [image_b]),
             ("What is this digit plus one?", "10", [image_a]), ("no image here", "odd", [])]
    batched = plugin.score_batch(items)
    single = [plugin.score_batch([item])[0] for item in items]
    for (nll_b, greedy_b), (nll_s, greedy_s) in zip(batched, single):
        assert nll_b == pytest.approx(nll_s, rel=1e-4, abs=1e-4)
        assert greedy_b == greedy_s


# ----- generation -----
def _requests(plugin, docs, gen_kwargs):
    plugin.task_dict = {"toy": {"test": docs}}
    return [SimpleNamespace(args=(doc["question"], dict(gen_kwargs), lambda d: [d["image"]] if d["image"] else [],
                                  i, "toy", "test")) for i, doc in enumerate(docs)]


def test_generate_until_batched_equals_single_and_cuts_until(plugin, data_dir):
    docs = [{"question": "What digit is this?", "image": _digit_image(data_dir, 2)},
            {"question": "Is it even or odd? Answer with one word.", "image": _digit_image(data_dir, 13)},
            {"question": "Say something.", "image": None}]
    gen = {"max_new_tokens": 6, "temperature": 0, "do_sample": False, "until": ["<|end|>"]}
    batched = plugin.generate_until(_requests(plugin, docs, gen))
    single = [plugin.generate_until(_requests(plugin, [doc], gen))[0] for doc in docs]
    assert batched == single and all(isinstance(t, str) for t in batched)
    cut = batched[0][1:3]
    if cut:  # any generated substring used as a stop string truncates the text before it
        again = plugin.generate_until(_requests(plugin, docs[:1], {**gen, "until": [cut]}))[0]
        assert again == batched[0].split(cut)[0]


def test_generate_until_beam_search_is_the_models(plugin, data_dir, monkeypatch):
    """A task's num_beams reaches the model's generate (beam search on the concept cache); a generation
    kwarg the plugin does not use is named in a warning, never dropped silently."""
    docs = [{"question": "What digit is this?", "image": _digit_image(data_dir, 2)}]
    seen = []
    original = plugin._model.generate
    monkeypatch.setattr(plugin._model, "generate", lambda **kw: seen.append(kw) or original(**kw))
    gen = {"max_new_tokens": 4, "temperature": 0, "num_beams": 3, "until": ["<|end|>"]}
    plugin.generate_until(_requests(plugin, docs, gen))
    assert seen[-1]["num_beams"] == 3 and seen[-1]["top_k"] is None
    with pytest.warns(UserWarning, match=r"generation kwargs not used: \['image_aspect_ratio'\]"):
        plugin.generate_until(_requests(plugin, docs, {**gen, "image_aspect_ratio": "pad"}))


def test_prompt_placeholders():
    assert build_prompt("Q?", 1) == "<image>\nQ?"
    assert build_prompt("Q?", 0) == "Q?"
    assert build_prompt("<image> and <image>: Q?", 2) == "<image> and <image>: Q?"
    with pytest.raises(ValueError, match="placeholders"):
        build_prompt("<image> Q?", 2)


def test_multi_round_is_not_supported(plugin):
    with pytest.raises(NotImplementedError, match="generate_until_multi_round"):
        plugin.generate_until_multi_round([])


def test_broken_checkpoint_path_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        lmms_plugin.ConceptMoEVLMEval(pretrained=str(tmp_path / "missing"), device="cpu")


# ----- text evaluation maths -----
def test_text_eval_uniform_model_gives_vocab_perplexity(tiny, data_dir):
    from transformers import AutoTokenizer

    from eval_suites.text_eval import document_start_id, encode_text, score_stream

    lm = tiny[0].language_model
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data_dir, "tokenizer"))
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 4
    ids, n_bytes = encode_text(tokenizer, text)
    assert n_bytes == len(text.encode("utf-8"))
    handle = lm.lm_head.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        raw = score_stream(lm, [document_start_id(tokenizer)] + ids, seq_len=32, batch_size=4)
    finally:
        handle.remove()
    vocab = lm.config.vocab_size
    assert raw["tokens"] == len(ids)
    assert raw["nll"] / raw["tokens"] == pytest.approx(math.log(vocab), rel=1e-5)
    # hard boundaries in eval mode: concepts = boundary count, ratio agrees with the model's own stat
    ids_t = torch.tensor([[document_start_id(tokenizer)] + ids[:32]])
    with torch.no_grad():
        out = lm(input_ids=ids_t)
    assert out.compression["ratio"] == pytest.approx(ids_t.numel() / int(out.boundary_mask.sum()))
    assert 1.0 <= raw["tokens_in_chunker"] / raw["concepts"] <= 32
