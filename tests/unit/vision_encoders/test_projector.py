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
