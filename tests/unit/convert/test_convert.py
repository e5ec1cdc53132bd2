"""Continual-training conversion: weights copied, R = 1 identity, the converted model trains."""
import pytest
import torch

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.convert import convert, identity_gap, main


@pytest.fixture
def baseline_dir(tmp_path):
    cfg = ConceptMoEConfig.from_yaml("configs/model/tiny.yaml", vocab_size=256)
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(64).repeat(4, 1) % 256
    for _ in range(5):  # a briefly trained baseline, not the init
        loss = model(data, labels=data).loss
        opt.zero_grad(), loss.backward(), opt.step()
    model.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


@pytest.mark.parametrize("strategy", ["topk", "loop"])
def test_conversion_is_exact_at_r1_and_copies_every_weight(baseline_dir, tmp_path, strategy):
    base, model, new_keys = convert(baseline_dir, tmp_path / "out", ratio=1.5, strategy=strategy)
    cfg = model.config
    assert cfg.chunking and cfg.concept_merge == "last" and cfg.router_init == "random"
    assert cfg.num_experts == base.config.num_experts
    assert all(("chunker" in k) or ("_c_proj" in k) for k in new_keys)
    for name, p in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    for k in new_keys:
        if "_c_proj" in k:
            assert model.state_dict()[k].abs().max() == 0  # joint decoding starts neutral
    if strategy == "loop":
        assert cfg.concept_loop_layers
    assert identity_gap(base, model, cfg.vocab_size) < 1e-5
    reloaded = ConceptMoEForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.concept_top_k == cfg.concept_top_k


def test_converted_model_trains(baseline_dir, tmp_path):
    _, model, _ = convert(baseline_dir, tmp_path / "out", ratio=1.5, strategy="topk")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(64).repeat(4, 1) % 256
    losses = []
    for _ in range(15):
        loss = model(data, labels=data).loss
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_cli_check_and_errors(baseline_dir, tmp_path, capsys):
    assert main(["--from", str(baseline_dir), "--to", str(tmp_path / "o"), "--ratio", "2", "--check"]) == 0
    assert "identity check" in capsys.readouterr().out
    assert main(["--from", str(tmp_path / "o"), "--to", str(tmp_path / "o2")]) == 2  # already chunked
    assert main(["--from", str(tmp_path / "nowhere"), "--to", str(tmp_path / "o3")]) == 2


def test_vlm_conversion_keeps_vision_and_projector(tmp_path):
    from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration
    cfg = ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", **{"chunking.enabled": False},
                                        vocab_size=64, image_token_id=5, im_start_token_id=6, im_end_token_id=7)
    torch.manual_seed(0)
    ConceptMoEVLMForConditionalGeneration(cfg).save_pretrained(tmp_path / "base")
    base, model, _ = convert(tmp_path / "base", tmp_path / "out", ratio=2.0, strategy="topk")
    assert model.config.text_config.chunking
    for name, p in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    assert identity_gap(base, model, 64) < 1e-5
