"""Projector: output shapes, 2x2 pixel-shuffle merge order, and config/grid errors.

Every test runs on ``VLM_TEST_DEVICE`` in fp32 (tests/_device.py)."""

import pytest
import torch
from torch import nn

from vlm.modeling.projector import ProjectorConfig, build_projector

from _device import dev, require_test_device  # noqa: E402, F401

pytestmark = pytest.mark.device


@pytest.mark.parametrize("kind", ["linear", "mlp2x_gelu"])
def test_projection_shapes(kind):
    projector = dev(build_projector(ProjectorConfig(kind=kind), vision_dim=64, lm_dim=32, patch_grid=(4, 4)))
    assert projector(dev(torch.randn(2, 16, 64))).shape == (2, 16, 32)
    assert projector(dev(torch.randn(2, 17, 64))).shape == (2, 17, 32)  # a CLS token passes through unmerged
    assert projector.num_output_tokens(16) == 16 and projector.output_grid == (4, 4)
    assert any(isinstance(m, nn.GELU) for m in projector.modules()) == (kind == "mlp2x_gelu")


def _identity_merge_projector(patch_grid):
    """A linear pixel_shuffle2x2 projector on 1-dim features whose projection is the identity."""
    projector = build_projector(ProjectorConfig(kind="linear", merge="pixel_shuffle2x2"), 1, 4, patch_grid)
    with torch.no_grad():
        projector.proj.weight.copy_(torch.eye(4))
        projector.proj.bias.zero_()
    return dev(projector)


def test_pixel_shuffle_groups_2x2_neighbourhoods_in_raster_order():
    projector = _identity_merge_projector((4, 4))
    patch_ids_BPD = dev(torch.arange(16.0).view(1, 16, 1))  # patch (r, c) holds 4r + c
    with torch.no_grad():
        tokens_BQd = projector(patch_ids_BPD)
    assert tokens_BQd.shape == (1, 4, 4)
    assert projector.num_output_tokens(16) == 4 and projector.output_grid == (2, 2)
    expected = dev(torch.tensor([
        [0, 1, 4, 5],  # patches (0,0) (0,1) (1,0) (1,1)
        [2, 3, 6, 7],
        [8, 9, 12, 13],
        [10, 11, 14, 15],
    ]).float())
    assert torch.equal(tokens_BQd[0], expected)


def test_pixel_shuffle_rectangular_grid():
    projector = _identity_merge_projector((2, 4))
    with torch.no_grad():
        tokens_BQd = projector(dev(torch.arange(8.0).view(1, 8, 1)))
    assert projector.output_grid == (1, 2)
    assert torch.equal(tokens_BQd[0], dev(torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7]]).float()))


def test_pixel_shuffle_mlp_shapes():
    projector = dev(build_projector(ProjectorConfig(merge="pixel_shuffle2x2"), vision_dim=64, lm_dim=32,
                                    patch_grid=(4, 4)))
    assert projector.proj[0].in_features == 256
    assert projector(dev(torch.randn(3, 16, 64))).shape == (3, 4, 32)


def test_pixel_shuffle_errors():
    with pytest.raises(ValueError, match="even patch grid, got 3x4"):
        build_projector(ProjectorConfig(merge="pixel_shuffle2x2"), vision_dim=8, lm_dim=8, patch_grid=(3, 4))
    projector = dev(build_projector(ProjectorConfig(merge="pixel_shuffle2x2"), vision_dim=8, lm_dim=8, patch_grid=(4, 4)))
    with pytest.raises(ValueError, match="keep_cls"):
        projector(dev(torch.randn(1, 17, 8)))
    with pytest.raises(ValueError, match="keep_cls"):
        projector.num_output_tokens(17)


@pytest.mark.parametrize(("kwargs", "field"), [({"kind": "mlp3x"}, "projector.kind"), ({"merge": "3x3"}, "projector.merge")])
def test_bad_config_values_name_the_field(kwargs, field):
    from vlm.modeling.config_base import ConfigError, build

    with pytest.raises(ValueError, match=field.split(".")[1]):  # direct construction: pydantic names the field
        ProjectorConfig(**kwargs)
    with pytest.raises(ConfigError, match=rf"^config error: {field}: "):  # the config route: the dotted field
        build(ProjectorConfig, kwargs, "projector.")


# --- avg_pool2x2 and prune_topk (issue 40) ---------------------------------------------------------
def test_avg_pool_equals_avg_pool2d_on_the_grid():
    import torch.nn.functional as F

    projector = dev(build_projector(ProjectorConfig(kind="linear", merge="avg_pool2x2"), 8, 8, (4, 6)))
    with torch.no_grad():
        projector.proj.weight.copy_(torch.eye(8))
        projector.proj.bias.zero_()
        x_BPD = dev(torch.randn(2, 24, 8))
        tokens_BQD = projector(x_BPD)
    grid_BDHW = x_BPD.transpose(1, 2).reshape(2, 8, 4, 6)
    expected_BQD = F.avg_pool2d(grid_BDHW, 2).flatten(2).transpose(1, 2)
    assert tokens_BQD.shape == (2, 6, 8) and projector.output_grid == (2, 3) and projector.num_output_tokens(24) == 6
    torch.testing.assert_close(tokens_BQD, expected_BQD)
    with pytest.raises(ValueError, match="even patch grid"):
        build_projector(ProjectorConfig(merge="avg_pool2x2"), 8, 8, (3, 4))


def _identity_prune_projector(keep, grid=(4, 4), dim=4):
    projector = build_projector(ProjectorConfig(kind="linear", merge="prune_topk", keep=keep), dim, dim, grid)
    with torch.no_grad():
        projector.proj.weight.copy_(torch.eye(dim))
        projector.proj.bias.zero_()
    return dev(projector)


def test_prune_keeps_the_largest_norms_in_raster_order():
    projector = _identity_prune_projector(keep=5)
    x_BPD = dev(torch.randn(3, 16, 4))
    with torch.no_grad():
        tokens_BKD = projector(x_BPD)
        kept_BK = projector.keep_indices(x_BPD)
    assert tokens_BKD.shape == (3, 5, 4) and projector.num_output_tokens(16) == 5
    norms_BP = x_BPD.norm(dim=-1)
    for b in range(3):
        kept = kept_BK[b].tolist()
        assert kept == sorted(kept)  # original order
        assert set(kept) == set(norms_BP[b].topk(5).indices.tolist())  # the dominant tokens
        torch.testing.assert_close(tokens_BKD[b], x_BPD[b, kept])  # zero position embedding at init


def test_prune_adds_each_kept_patch_position():
    projector = _identity_prune_projector(keep=2)
    with torch.no_grad():
        projector.pos_embed_PD.copy_(dev(torch.arange(16.0)[:, None].expand(16, 4)))
        x_BPD = dev(torch.zeros(1, 16, 4))
        x_BPD[0, 3] = 10.0
        x_BPD[0, 12] = 20.0
        tokens_BKD = projector(x_BPD)
    assert tokens_BKD[0, :, 0].tolist() == [13.0, 32.0]  # patch 3 (10 + pos 3), patch 12 (20 + pos 12)


def test_prune_keep_errors():
    from vlm.modeling.config_base import ConfigError

    with pytest.raises(ConfigError, match=r"projector\.keep: is required with merge 'prune_topk'"):
        build_projector(ProjectorConfig(merge="prune_topk"), 8, 8, (4, 4))
    with pytest.raises(ConfigError, match=r"projector\.keep: is required"):
        build_projector(ProjectorConfig(merge="avg_pool2x2", keep=4), 8, 8, (4, 4))
    with pytest.raises(ConfigError, match="exceeds the 16 patches"):
        build_projector(ProjectorConfig(merge="prune_topk", keep=17), 8, 8, (4, 4))


@pytest.mark.parametrize(("merge", "keep", "expected"), [("none", None, 64), ("pixel_shuffle2x2", None, 16),
                                                         ("avg_pool2x2", None, 16), ("prune_topk", 16, 16),
                                                         ("prune_topk", 11, 11)])
def test_accountant_image_tokens_and_params(merge, keep, expected):
    from vlm.flops import image_tokens_per_image, projector_params

    cfg = ProjectorConfig(merge=merge, keep=keep)
    projector = build_projector(cfg, 64, 32, (8, 8))
    assert image_tokens_per_image(cfg, (8, 8)) == projector.num_output_tokens(64) == expected
    assert image_tokens_per_image(cfg.model_dump(), (8, 8)) == expected
    assert projector_params(cfg, 64, 32, (8, 8)) == sum(p.numel() for p in projector.parameters())
    with torch.no_grad():
        assert projector(torch.randn(2, 64, 64)).shape == (2, expected, 32)
