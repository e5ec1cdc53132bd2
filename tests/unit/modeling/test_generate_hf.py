"""Generation through transformers' ``GenerationMixin.generate`` over the ConceptCache (vlm/modeling/cache.py).

References are computed with repeated full forwards (no cache): beam search and seeded sampling with
the same logits processors as transformers. Also: beam reordering of every tensor of the decode
state, streamer, ``return_dict_in_generate`` + scores, eos lists, the generation config (defaults,
save / load, no MoE ``top_k`` warning), one-line refusals. Routers as in test_generation.py
(``fractional``: p spread over (0, 1), so beam reordering of the EMA carry is checked too)."""
from __future__ import annotations

import dataclasses
import logging as py_logging

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                                     TopPLogitsWarper)
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from vlm.modeling.cache import ConceptCache, select_rows, state_tensors
from vlm.modeling.hf_features import returned_cache
from vlm.modeling.chunking import IMAGE, TEXT, ChunkCarry
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

from _device import dev, require_test_device, tol  # noqa: E402, F401
from conftest import randomise_joint  # noqa: E402
from test_generation import fractional, left_padded  # noqa: E402

pytestmark = pytest.mark.device


def lm(tiny_model, merge="sum", **overrides):
    return dev(fractional(randomise_joint(tiny_model("tiny_concept", concept_merge=merge, **overrides))))


def grow(mask, mod=None):
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return mask, None if mod is None else torch.cat([mod, torch.full_like(mod[:, :1], TEXT)], 1)


@torch.no_grad()
def beam_reference(last_logits, ids, am, n, K, mod=None):
    """Plain beam search over repeated full forwards (``last_logits(seq, mask, mod)`` -> [B*K, V] at the
    last position): keep the K best continuations of each row by summed log-probability (no eos, so
    no beam finishes early). Returns the best sequence per row and its summed log-probability."""
    B = ids.shape[0]
    seq, mask = ids.repeat_interleave(K, 0), am.repeat_interleave(K, 0)
    mod = None if mod is None else mod.repeat_interleave(K, 0)
    score = torch.full((B, K), float("-inf"), device=ids.device)
    score[:, 0] = 0.0
    for _ in range(n):
        logp = last_logits(seq, mask, mod).float().log_softmax(-1)
        V = logp.shape[-1]
        score, flat = (score[..., None] + logp.view(B, K, V)).view(B, K * V).topk(K, dim=-1)
        rows = (torch.arange(B, device=ids.device)[:, None] * K + flat // V).view(-1)
        seq = torch.cat([seq[rows], (flat % V).view(-1, 1)], 1)
        mask, mod = grow(mask[rows], None if mod is None else mod[rows])
    best = score.argmax(-1)
    return seq.view(B, K, -1)[torch.arange(B), best], score.max(-1).values


def lm_logits(model):
    def last(seq, mask, mod):
        return model(seq, attention_mask=mask, **({} if mod is None else {"modality_ids": mod})).logits[:, -1]
    return last


@pytest.mark.parametrize("merge, split", [("last", False), ("sum", False), ("sum", True)])
def test_beam_search_equals_reference(tiny_model, merge, split):
    """num_beams=3 on a left-padded batch (and a prompt ending on image tokens with split_at_switch):
    every step reorders the concept cache, the token caches and the chunk carry along the beams."""
    model = lm(tiny_model, merge, **({"modality_policy": "split_at_switch"} if split else {}))
    ids, am = left_padded()
    mod = None
    if split:
        mod = torch.full_like(ids, TEXT)
        mod[:, 6:] = IMAGE
    n, K = 10, 3
    want, want_score = beam_reference(lm_logits(model), ids, am, n, K, mod)
    kw = {} if mod is None else {"modality_ids": mod}
    out = model.generate(ids, attention_mask=am, max_new_tokens=n, num_beams=K, do_sample=False,
                         return_dict_in_generate=True, output_scores=True, **kw)
    assert torch.equal(out.sequences, want)
    torch.testing.assert_close(out.sequences_scores * n, want_score, **tol(1e-4, 1e-4))
    assert len(out.scores) == n and out.scores[0].shape == (2 * K, model.config.vocab_size)
    assert torch.equal(model.generate(ids, attention_mask=am, max_new_tokens=n, num_beams=K, use_cache=False, **kw),
                       want)


@torch.no_grad()
def sample_reference(model, ids, am, n, procs, seed):
    torch.manual_seed(seed)
    seq, mask = ids, am
    for _ in range(n):
        scores = procs(seq, model(seq, attention_mask=mask).logits[:, -1].float())
        seq = torch.cat([seq, torch.multinomial(scores.softmax(-1), 1)], 1)
        mask, _ = grow(mask)
    return seq


def test_seeded_sampling_equals_full_forwards(tiny_model):
    """Same seed, same logits processors (transformers' order): identical tokens to sampling over
    repeated full forwards; also with num_return_sequences=2 (rows repeated before the prefill)."""
    model = lm(tiny_model)
    ids, am = left_padded()
    n = 16
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8),
                                 TopKLogitsWarper(50), TopPLogitsWarper(0.9)])
    kw = dict(max_new_tokens=n, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.3)
    want = sample_reference(model, ids, am, n, procs, seed=3)
    torch.manual_seed(3)
    out = model.generate(ids, attention_mask=am, **kw)
    assert torch.equal(out, want)
    assert not torch.equal(out, model.generate(ids, attention_mask=am, max_new_tokens=n))
    want = sample_reference(model, ids.repeat_interleave(2, 0), am.repeat_interleave(2, 0), n, procs, seed=4)
    torch.manual_seed(4)
    out = model.generate(ids, attention_mask=am, num_return_sequences=2, **kw)
    assert torch.equal(out, want) and not torch.equal(out[0], out[1])


def test_beam_sample_cached_equals_uncached(tiny_model):
    """Beam sampling (num_beams=3, do_sample): the same seed gives the same sequences with the concept
    cache as with repeated full forwards (use_cache=False), so the reordered cache is exact there too."""
    model = lm(tiny_model, "last")
    ids, am = left_padded()
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=True, temperature=1.5)
    torch.manual_seed(5)
    cached = model.generate(ids, attention_mask=am, **kw)
    torch.manual_seed(5)
    assert torch.equal(cached, model.generate(ids, attention_mask=am, use_cache=False, **kw))
    assert not torch.equal(cached, model.generate(ids, attention_mask=am, max_new_tokens=8, num_beams=3))


def test_cache_reorder_selects_every_tensor(tiny_model):
    """``reorder_cache`` == the state of the reordered batch, for every tensor of the DecodeState
    (token and concept KV caches, positions, every ChunkCarry field), after a prefill and one step."""
    model = lm(tiny_model, "sum", modality_policy="split_at_switch")
    ids, am = left_padded(B=3, T=12, pad=4)
    mod = torch.full_like(ids, TEXT)
    mod[:, 7:] = IMAGE
    perm = dev(torch.tensor([2, 0, 0]))
    a, b = ConceptCache(16), ConceptCache(16)
    with torch.no_grad():
        model(ids, attention_mask=am, modality_ids=mod, cache=a)
        model(ids[perm], attention_mask=am[perm], modality_ids=mod[perm], cache=b)
        a.reorder_cache(perm)
        tok = dev(torch.tensor([[11], [12], [12]]))
        model(tok, cache=a), model(tok, cache=b)
    assert all(getattr(a.state, f.name) is not None for f in dataclasses.fields(ChunkCarry))
    ta, tb = state_tensors(a.state), state_tensors(b.state)
    n_caches = len(a.state.token_caches) + len(a.state.concept_caches)
    assert ta.keys() == tb.keys() and len(ta) == len(dataclasses.fields(a.state)) - 2 + 4 * n_caches
    for name in ta:
        assert ta[name].shape[0] == 3, name
        if ta[name].is_floating_point():
            torch.testing.assert_close(ta[name], tb[name], **tol(1e-5, 1e-5), msg=name)
        else:
            assert torch.equal(ta[name], tb[name]), name
    with pytest.raises(TypeError, match="cannot select"):
        select_rows(dataclasses.replace(a.state, next_pos_B=3), perm)


class Collect(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def test_streamer_and_return_dict(tiny_model):
    model = lm(tiny_model)
    ids, am = left_padded()
    T, n = ids.shape[1], 8
    streamer = Collect()
    out = model.generate(ids, attention_mask=am, max_new_tokens=n, streamer=streamer, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    assert torch.equal(streamer.puts[0], ids.cpu()) and streamer.ended == 1
    assert torch.equal(torch.stack(streamer.puts[1:], 1), out.sequences[:, T:].cpu())
    assert out.sequences.shape == (2, T + n) and len(out.scores) == n and len(out.logits) == n
    assert all(s.shape == (2, model.config.vocab_size) for s in out.scores)
    assert torch.equal(torch.stack([s.argmax(-1) for s in out.scores], 1), out.sequences[:, T:])
    cache = returned_cache(out)   # out.cache (or out.past_key_values on older transformers)
    assert isinstance(cache, ConceptCache) and cache.get_seq_length() == T + n - 1
    with torch.no_grad():
        full = model(out.sequences, attention_mask=torch.cat([am, torch.ones_like(am[:, :n])], 1)).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, T - 1:-1], **tol(1e-4, 1e-4))


def test_continue_from_returned_cache(tiny_model):
    """``cache=out.cache`` with ``out.sequences`` continues exactly (the last token is fed); any other
    input length is refused in one line."""
    model = lm(tiny_model)
    ids, am = left_padded()
    whole = model.generate(ids, attention_mask=am, max_new_tokens=10)
    first = model.generate(ids, attention_mask=am, max_new_tokens=6, return_dict_in_generate=True)
    mask = torch.cat([am, torch.ones_like(am[:, :6])], 1)
    rest = model.generate(first.sequences, attention_mask=mask, cache=returned_cache(first), max_new_tokens=4)
    assert torch.equal(rest, whole)
    with pytest.raises(ValueError, match="continues"):
        short = rest[:, :-3]  # the cache holds ids + 9 tokens now: 8 + one new would be wrong
        model.generate(short, attention_mask=torch.cat([am, torch.ones_like(am[:, :7])], 1), cache=returned_cache(first),
                       max_new_tokens=2)


def test_eos_list_and_generation_config(tiny_model, tmp_path):
    """Defaults come from the config's special ids; a list of eos ids stops each row at its first one;
    the generation config is saved with the model and used by generate after loading."""
    model = dev(tiny_model("tiny_concept", eos_token_id=[5, 7], pad_token_id=3))
    gc = model.generation_config
    assert gc.eos_token_id == [5, 7] and gc.pad_token_id == 3 and gc.top_k is None and gc.bos_token_id is None
    ids, am = left_padded()
    T = ids.shape[1]
    free = model.generate(ids, attention_mask=am, max_new_tokens=12, eos_token_id=None)
    stops = [int(free[0, T + 2]), int(free[1, T + 4])]
    out = model.generate(ids, attention_mask=am, max_new_tokens=12, eos_token_id=stops, pad_token_id=3)
    for r in range(2):
        first = next(i for i in range(T, free.shape[1]) if int(free[r, i]) in stops)
        assert torch.equal(out[r, : first + 1], free[r, : first + 1])
        assert bool((out[r, first + 1:] == 3).all())
    model.generation_config.max_new_tokens = 5
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    loaded = dev(ConceptMoEForCausalLM.from_pretrained(tmp_path).eval())
    assert loaded.generation_config.max_new_tokens == 5 and loaded.generation_config.top_k is None
    assert loaded.generate(ids, attention_mask=am).shape == (2, T + 5)


def test_stop_strings(tiny_model, tmp_path):
    """``stop_strings`` (with the tokenizer): generation ends at the first generated token that
    completes the string, the tokens before it unchanged."""
    from _data_helpers import tiny_tokenizer
    tok = tiny_tokenizer(str(tmp_path / "tok"), with_specials=False)
    model = dev(tiny_model("tiny_concept", vocab_size=len(tok)))
    ids = dev(torch.randint(1, len(tok), (1, 10), generator=torch.Generator().manual_seed(2)))
    free = model.generate(ids, max_new_tokens=12)
    texts = [tok.decode(free[0, i:i + 1]) for i in range(10, 22)]
    k = next(i for i, t in enumerate(texts) if i > 0 and len(t.strip()) > 1 and t.isprintable() and "\ufffd" not in t)
    out = model.generate(ids, max_new_tokens=12, stop_strings=[texts[k]], tokenizer=tok)
    assert out.shape[1] <= 10 + k + 1 < free.shape[1] and torch.equal(out[0], free[0, : out.shape[1]])
    assert tok.decode(out[0, 10:]).endswith(texts[k])


def _generation_warnings(fn, mark: str = "generation flags") -> list[str]:
    """transformers' log records containing ``mark`` (their warnings are logged once per process: the
    cache is cleared)."""
    records = []
    handler = py_logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    root = hf_logging.get_logger("transformers")
    hf_logging.get_logger("transformers").warning_once.cache_clear()
    root.addHandler(handler)
    try:
        fn()
    finally:
        root.removeHandler(handler)
    return [r for r in records if mark in r]


def test_no_top_k_warning_at_load(tiny_model, tmp_path):
    """The MoE ``top_k`` no longer reaches the generation config: no warning when a saved model is
    loaded, with or without generation_config.json (then built from the config's special ids)."""
    model = tiny_model("tiny")
    assert _generation_warnings(lambda: GenerationConfig.from_model_config(model.config))  # the check sees it
    model.save_pretrained(tmp_path / "a")
    assert not _generation_warnings(lambda: ConceptMoEForCausalLM.from_pretrained(tmp_path / "a"))
    model.save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "generation_config.json").unlink()
    got = []
    assert not _generation_warnings(lambda: got.append(ConceptMoEForCausalLM.from_pretrained(tmp_path / "b")))
    assert got[0].generation_config.top_k is None and got[0].generation_config.pad_token_id == 0


REFUSED = {
    "assisted": dict(prompt_lookup_num_tokens=3),
    "contrastive": dict(penalty_alpha=0.6, top_k=4),
    "group_beams": dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
    "dola": dict(dola_layers="low"),
    "cache_implementation": dict(cache_implementation="static"),
    "chunked_prefill": dict(prefill_chunk_size=4),
    "attentions": dict(output_attentions=True, return_dict_in_generate=True),
    "cfg": dict(guidance_scale=1.5),
    "generator": dict(do_sample=True, generator=torch.Generator()),
    "foreign_cache": dict(cache="DynamicCache"),
    "beam_streamer": dict(num_beams=2, streamer=Collect()),
}


@pytest.mark.parametrize("kw", REFUSED.values(), ids=REFUSED.keys())
def test_unsupported_option_raises_one_line(tiny_model, kw):
    from transformers import DynamicCache
    model = dev(tiny_model("tiny_concept"))
    ids, am = left_padded()
    kw = {k: DynamicCache() if v == "DynamicCache" else v for k, v in kw.items()}
    with pytest.raises(ValueError) as err:
        model.generate(ids, attention_mask=am, max_new_tokens=3, **kw)
    msg = str(err.value)
    assert "\n" not in msg and ("not supported" in msg or "cannot be used" in msg), msg


def test_vlm_beam_search_and_streamer_with_images():
    """The VLM: image features spliced into the prompt's embeddings once (the prefill), then the LM's
    GenerationMixin: beam search (num_beams=2) equals the reference over full VLM forwards (the beams
    of row 0 carry its two images), also with the fixed-shape step (``decode="static"``), the streamer
    gets the prompt ids then each new token."""
    from test_vlm_model import build, sample_batch
    model = build(**{"chunking.concept_merge": "sum"})
    randomise_joint(model.language_model)
    fractional(model.language_model, model.projector)
    model = dev(model)
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    ids, mask = ids[:, :-4], mask[:, :-4]  # row 0 ends on image tokens
    n, K = 8, 2
    beam_pixels = torch.cat([pixels] * K)  # only row 0 has images (pixels[0:2]): its K beams come first
    want, want_score = beam_reference(lambda seq, m, _: model(seq, beam_pixels, m).logits[:, -1], ids, mask, n, K)
    out = model.generate(ids, pixels, mask, max_new_tokens=n, num_beams=K, return_dict_in_generate=True,
                         output_scores=True)
    assert torch.equal(out.sequences, want)
    torch.testing.assert_close(out.sequences_scores * n, want_score, **tol(1e-4, 1e-4))
    static = model.generate(ids, pixels, mask, max_new_tokens=n, num_beams=K, decode="static")  # decode_graph.py
    assert torch.equal(static, want)
    streamer = Collect()
    greedy = model.generate(ids, pixels, mask, max_new_tokens=n, streamer=streamer)
    assert torch.equal(streamer.puts[0], ids.cpu()) and streamer.ended == 1
    assert torch.equal(torch.stack(streamer.puts[1:], 1), greedy[:, ids.shape[1]:].cpu())


def test_vlm_is_a_generation_model_with_a_saved_generation_config(tmp_path):
    """The VLM is a GenerationMixin (pipelines check ``can_generate``): its generation config (special
    ids only) is saved as generation_config.json and loads back without the top_k warning."""
    from test_vlm_model import build

    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration as VLM

    model = build()
    assert VLM.can_generate() and model.generation_config.top_k is None
    model.generation_config.max_new_tokens = 7
    model.save_pretrained(tmp_path / "vlm")
    assert (tmp_path / "vlm" / "generation_config.json").is_file()
    got = []
    assert not _generation_warnings(lambda: got.append(VLM.from_pretrained(tmp_path / "vlm")))
    assert got[0].generation_config.max_new_tokens == 7
    assert got[0].generation_config.eos_token_id == model.config.text_config.eos_token_id


def test_vlm_generate_passes_no_generation_config_beside_options():
    """The VLM's own generation config holds (here its max_new_tokens) and an option given to generate
    wins, without transformers' "Passing `generation_config` together with ..." warning."""
    from test_vlm_model import build, sample_batch
    model = build()
    ids, mask, pixels = sample_batch(model.num_image_tokens)
    model.generation_config.max_new_tokens = 3
    lm_config = model.language_model.generation_config
    got = {}

    def run():
        got["own"] = model.generate(ids, pixels, mask)
        got["option"] = model.generate(ids, pixels, mask, max_new_tokens=5, do_sample=False)

    warned = _generation_warnings(run, mark="generation_config")
    assert not warned, warned
    assert got["own"].shape[1] == ids.shape[1] + 3 and got["option"].shape[1] == ids.shape[1] + 5
    assert torch.equal(got["option"][:, :ids.shape[1] + 3], got["own"])  # greedy either way
    assert model.language_model.generation_config is lm_config
