"""The VLM: placeholder expansion, cross-modal chunking policies, causality, save/load, generation.

Tests marked ``device`` run on ``VLM_TEST_DEVICE`` (tests/_device.py; fp32, and bf16 on CUDA for the
forward/backward finiteness test); models are built (and made decisive) on the CPU, then moved.
The statistical router-training test and the config test stay on the CPU."""
import pytest
import torch

from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration, ImageTokenMismatch

from _device import dev, dtype_for, require_test_device, tol  # noqa: E402, F401
from _export import saved_equals_live  # noqa: E402
from conftest import randomise_joint  # noqa: E402
from test_generation import check_fractional, fractional  # noqa: E402  (the fractional router)

IMG, START, END = 5, 6, 7
VOCAB = 64


def build(seed=0, **overrides) -> ConceptMoEVLMForConditionalGeneration:
    cfg = ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", image_token_id=IMG, im_start_token_id=START,
                                        im_end_token_id=END, vocab_size=VOCAB, **overrides)
    torch.manual_seed(seed)
    return ConceptMoEVLMForConditionalGeneration(cfg).eval()


def decisive(model, seed=0):
    """W_q = W_k = u u^T: cos(q_n, k_{n-1}) = +-1, so p is 0 or 1 and hard boundaries are stable."""
    g = torch.Generator().manual_seed(seed)
    ch = model.language_model.model.chunker
    u = torch.randn(ch.q_proj.weight.shape[0], generator=g)
    u = u / u.norm()
    with torch.no_grad():
        ch.q_proj.weight.copy_(torch.outer(u, u))
        ch.k_proj.weight.copy_(torch.outer(u, u))
    return model


def sample_batch(P, seed=0):
    """Row 0: text, image, text, image, text. Row 1: left padding, text only."""
    g = torch.Generator().manual_seed(seed)
    txt = lambda n: torch.randint(8, VOCAB, (n,), generator=g).tolist()
    image = [START] + [IMG] * P + [END]
    row0 = txt(3) + image + txt(4) + image + txt(3)
    row1 = txt(len(row0) - 4)
    ids = torch.tensor([row0, [0] * 4 + row1])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    return ids, mask, pixels


@torch.no_grad()
def cached_vs_full(model, ids, mask, pixels, fed):
    """Prefill the prompt, feed ``fed`` [B, n] token by token; one full forward over prompt + fed.
    Returns the full forward's output, the cached path's logits [B, n + 1, V] (after the prefill and
    each fed token) and its boundary mask (a concept is cached exactly at each boundary)."""
    lm = model.language_model
    full = model(torch.cat([ids, fed], 1), pixels, torch.cat([mask, torch.ones_like(fed)], 1))
    embeds, modality = model.embed(ids, pixels)
    state = lm.start_decoding(ids.shape[0], ids.shape[1] + fed.shape[1] + 1)
    logits = [lm.prefill(state, inputs_embeds=embeds, attention_mask=mask, modality_ids=modality)]
    bounds, count = [lm._last_prefill.boundary_BT], state.concept_caches[0].num_entries().clone()
    for t in range(fed.shape[1]):
        logits.append(lm.step(state, fed[:, t]))
        grown = state.concept_caches[0].num_entries()
        bounds.append((grown > count)[:, None])
        count = grown.clone()
    return full, torch.stack(logits, 1), torch.cat(bounds, 1)


@torch.no_grad()
def greedy_by_full_forwards(model, ids, mask, pixels, n):
    cur, cur_mask = ids, mask
    for _ in range(n):
        nxt = model(cur, pixels, cur_mask).logits[:, -1].argmax(-1, keepdim=True)
        cur, cur_mask = torch.cat([cur, nxt], 1), torch.cat([cur_mask, torch.ones_like(nxt)], 1)
    return cur


@pytest.mark.device
def test_placeholder_count_mismatch_is_a_clear_error():
    model = dev(build())
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    with pytest.raises(ImageTokenMismatch, match="2 image"):
        model(ids[:, :10], pixels, mask[:, :10])  # cuts through the first image's tokens
    with pytest.raises(ImageTokenMismatch):
        model(ids, pixels[:1], mask)


@pytest.mark.device
def test_image_features_land_at_placeholders_in_order():
    model = dev(build())
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    embeds, modality = model.embed(ids, pixels)
    feats = model.projector(model.vision(pixels))
    pos = (ids[0] == IMG).nonzero()[:, 0]
    P = model.num_image_tokens
    assert torch.equal(embeds[0, pos[:P]], feats[0]) and torch.equal(embeds[0, pos[P:]], feats[1])
    assert modality.sum() == 2 * P and modality[1].sum() == 0


@pytest.mark.device
@pytest.mark.parametrize("policy", ["joint", "split_at_switch", "per_modality"])
def test_causality_across_modalities(policy):
    over = {"chunking.modality_policy": "joint" if policy == "per_modality" else policy}
    if policy == "per_modality":
        over.update({"image_target_ratio": 3.0, "text_target_ratio": 1.5})
    model = dev(decisive(build(**over)))
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    base = model(ids, pixels, mask)
    P = model.num_image_tokens
    second_img_start = int((ids[0] == START).nonzero()[1, 0])
    # a later text token changes nothing before it
    for t in (4, second_img_start - 1, ids.shape[1] - 2):
        ids2 = ids.clone()
        ids2[:, t + 1] = (ids2[:, t + 1] + 11) % (VOCAB - 8) + 8 if ids[0, t + 1] >= 8 else ids2[:, t + 1]
        ids2[1, t + 1] = (ids[1, t + 1] + 11) % (VOCAB - 8) + 8
        out = model(ids2, pixels, mask)
        assert torch.allclose(out.logits[:, : t + 1], base.logits[:, : t + 1], **tol(1e-5, 1e-5))
        assert torch.equal(out.boundary_mask[:, : t + 1], base.boundary_mask[:, : t + 1])
    # the second image's pixels change nothing before that image
    pixels2 = pixels.clone()
    pixels2[1] = dev(torch.randn(pixels2[1].shape))
    out = model(ids, pixels2, mask)
    first_patch = second_img_start + 1
    assert torch.allclose(out.logits[0, :first_patch], base.logits[0, :first_patch], **tol(1e-5, 1e-5))
    assert not torch.allclose(out.logits[0, first_patch:first_patch + P], base.logits[0, first_patch:first_patch + P])


@pytest.mark.device
def test_split_at_switch_has_a_boundary_at_every_switch():
    model = dev(build(**{"chunking.modality_policy": "split_at_switch"}))
    model.train()  # boundary noise on: forced boundaries must hold regardless
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    for seed in range(3):
        torch.manual_seed(seed)
        out = model(ids, pixels, mask)
        is_img = ids[0] == IMG
        switch = is_img[1:] != is_img[:-1]
        assert switch.sum() == 4
        assert out.boundary_mask[0, 1:][switch].all()


def test_per_modality_targets_pull_the_ratios_apart():
    """Only the router learns, from the ratio loss alone, on fresh batches; ratios measured in eval."""
    model = build(seed=1, image_target_ratio=3.0, text_target_ratio=1.5, router_init="random",
                  boundary_noise_tau=None)
    model.train()
    router = model.language_model.model.chunker
    opt = torch.optim.Adam(router.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.98)
    for step in range(100):
        ids, mask, pixels = sample_batch(model.num_image_tokens, seed=1000 + step)
        out = model(ids, pixels, mask)
        opt.zero_grad()
        out.ratio_loss.backward()
        opt.step()
        sched.step()
    model.eval()
    img, txt = [], []
    for seed in range(100, 108):
        ids, mask, pixels = sample_batch(model.num_image_tokens, seed=seed)
        comp = model(ids, pixels, mask).compression
        img.append(comp["ratio_image"]), txt.append(comp["ratio_text"])
    r_img, r_txt = sum(img) / len(img), sum(txt) / len(txt)
    print(f"per-modality eval ratios after training: image {r_img:.2f} (target 3.0), text {r_txt:.2f} (target 1.5)")
    assert abs(r_img - 3.0) / 3.0 < 0.2 and abs(r_txt - 1.5) / 1.5 < 0.2


@pytest.mark.device
def test_forward_backward_finite():
    """Train mode, both modalities, padding: a finite loss and a finite gradient for every parameter
    (the vision tower, projector, chunker, joint projections included); bf16 on CUDA."""
    model = dev(build(**{"chunking.modality_policy": "split_at_switch"})).to(dtype_for(exact=False)).train()
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    labels = ids.masked_fill((mask == 0) | (ids < 8), -100)
    out = model(ids, pixels, mask, labels=labels)
    assert torch.isfinite(out.loss) and out.logits.shape == (*ids.shape, VOCAB)
    out.loss.backward()
    bad = [n for n, p in model.named_parameters()
           if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())]
    assert not bad, bad
    assert next(model.vision.parameters()).grad.abs().sum() > 0


@pytest.mark.device
def test_generation_with_image_equals_repeated_full_forwards():
    model = dev(decisive(build()))
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    out = model.generate(ids, pixels, mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, greedy_by_full_forwards(model, ids, mask, pixels, 12))


@pytest.mark.device
@pytest.mark.parametrize("merge, policy", [("last", "joint"), ("sum", "joint"), ("last", "split_at_switch"),
                                           ("sum", "split_at_switch")])
def test_fractional_router_generation_with_image_equals_full_forwards(merge, policy):
    """The fractional router of test_generation (image tokens get their own router vector through the
    projector's bias): batch 2, row 0 with two images and its prompt ending on the second image's
    patch tokens, row 1 text with left padding. Fed 16 random text tokens, the cached path's
    boundaries and logits equal one full forward's, so the decode EMA carry and each concept's EMA
    weight are compared; greedy generate equals repeated full forwards."""
    model = build(**{"chunking.concept_merge": merge, "chunking.modality_policy": policy})
    randomise_joint(model.language_model)
    fractional(model.language_model, model.projector)
    model = dev(model)
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    ids, mask = ids[:, :-4], mask[:, :-4]  # row 0 now ends on image tokens
    assert int(ids[0, -1]) == IMG
    T = ids.shape[1]
    fed = dev(torch.randint(8, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5)))
    full, logits, bounds = cached_vs_full(model, ids, mask, pixels, fed)
    check_fractional(full, torch.cat([mask, torch.ones_like(fed)], 1))
    if policy == "split_at_switch":
        assert bool(full.boundary_mask[0, T])  # the first text token after an image
    assert torch.equal(bounds, full.boundary_mask)
    torch.testing.assert_close(logits, full.logits[:, T - 1:], **tol(1e-4, 1e-4))
    want = greedy_by_full_forwards(model, ids, mask, pixels, 8)
    assert torch.equal(model.generate(ids, pixels, mask, max_new_tokens=8, do_sample=False), want)


@pytest.mark.device
def test_save_and_load_gives_identical_logits(tmp_path):
    """A decisive (non-identity) router and non-zero joint projections, so that a weight the save
    drops (re-initialised on load) changes the boundaries and the logits; the saved keys are the live ones."""
    model = build()
    with torch.no_grad():
        decisive(model, seed=3)
        randomise_joint(model.language_model)
    ids, mask, pixels = sample_batch(model.num_image_tokens)
    ref = build()  # the same model with the identity router: the boundaries differ
    with torch.no_grad():
        assert not torch.equal(ref(ids, pixels, mask).boundary_mask, model(ids, pixels, mask).boundary_mask)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    saved_equals_live(model, tmp_path)
    loaded = ConceptMoEVLMForConditionalGeneration.from_pretrained(tmp_path).eval()
    model, loaded = dev(model, loaded)
    ids, mask, pixels = dev((ids, mask, pixels))
    with torch.no_grad():
        a, b = loaded(ids, pixels, mask), model(ids, pixels, mask)
    assert torch.equal(a.boundary_mask, b.boundary_mask)
    assert torch.equal(a.logits, b.logits)


@pytest.mark.device
@pytest.mark.parametrize("key, value", [("boundary_mode", "fixed"), ("concept_merge", "sum")])
def test_chunk_config_changed_after_loading(tmp_path, key, value):
    """The chunker reads ``config.text_config`` live: after loading a saved VLM, changing a chunk
    setting there changes the full forward, and cached decoding still equals it."""
    model = build()
    fractional(model.language_model, model.projector)
    model.save_pretrained(tmp_path)
    loaded = ConceptMoEVLMForConditionalGeneration.from_pretrained(tmp_path).eval()
    setattr(loaded.config.text_config, key, value)
    model, loaded = dev(model, loaded)
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    fed = dev(torch.randint(8, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6)))
    full, logits, bounds = cached_vs_full(loaded, ids, mask, pixels, fed)
    with torch.no_grad():
        assert not torch.allclose(full.logits[:, : ids.shape[1]], model(ids, pixels, mask).logits, atol=1e-3)
    assert torch.equal(bounds, full.boundary_mask)
    torch.testing.assert_close(logits, full.logits[:, ids.shape[1] - 1:], **tol(1e-4, 1e-4))
    want = greedy_by_full_forwards(loaded, ids, mask, pixels, 8)
    assert torch.equal(loaded.generate(ids, pixels, mask, max_new_tokens=8, do_sample=False), want)


def test_vlm_config_overrides_and_errors():
    from vlm import ConfigError
    cfg = ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", **{"vision.feature_layer": "penultimate",
                                                                           "moe.num_experts": 4})
    assert cfg.vision_config.feature_layer == "penultimate" and cfg.text_config.num_experts == 4
    assert cfg.text_config.chunking and cfg.text_config.target_ratio == 2.0
    with pytest.raises(ConfigError, match="vision.feature_layer"):
        ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", **{"vision.feature_layer": "middle"})
    with pytest.raises(ConfigError, match="modality_policy"):
        ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", **{"chunking.modality_policy": "nope"})
