"""Expert parallelism (vlm/training/expert_parallel.py) in one process: the dispatch over a 1-rank group
is the unsharded MoE layer exactly (outputs, losses, counts, gradients; a wrong axis in the all-to-all
split sizes fails here), and the settings EP cannot serve stop with one line. The multi-rank runs are in
tests/integration/training/test_expert_parallel.py."""
from __future__ import annotations

import pytest
import torch

import _train_helpers as helpers
from vlm.modeling.config_base import ConfigError


def test_ep_refused_by_the_trainer_with_one_line(tmp_path):
    raw = helpers.config(tmp_path, train={"max_steps": 1}, checkpoint={"every_steps": 0, "export_hf": False},
                         parallel={"expert_parallel_size": 2})
    with pytest.raises(ConfigError) as err:
        helpers.run_inprocess(raw, tmp_path)
    assert "must divide the world size 1" in str(err.value) and "\n" not in str(err.value)


def test_ep_refuses_zero3_and_indivisible_experts(tmp_path):
    from vlm.config.train import TrainConfig
    from vlm.training.expert_parallel import check_supported
    from vlm.modeling.moe import MoEFeedForward
    from vlm.modeling.configuration_conceptmoe import MoEConfig

    cfg = TrainConfig(parallel={"expert_parallel_size": 4})
    model = torch.nn.ModuleList([MoEFeedForward(8, MoEConfig(num_experts=6, top_k=2, moe_intermediate_size=4))])
    with pytest.raises(ConfigError) as err:
        check_supported(cfg, world_size=4, model=model, zero_stage=3)
    msg = str(err.value)
    assert "divide the number of experts 6" in msg and "ZeRO-3" in msg and "\n" not in msg


def test_dispatch_matches_the_unsharded_layer_in_one_process():
    """ExpertParallelMoE over a 1-rank group is the unsharded layer exactly (outputs, losses,
    counts, every gradient), and reads the host at its one named point only."""
    import copy

    from vlm.modeling.configuration_conceptmoe import MoEConfig
    from vlm.modeling.moe import MoEFeedForward, init_moe_weights
    from vlm.modeling.syncs import counting
    from vlm.training.distributed import init_distributed
    from vlm.training.expert_parallel import EP_SPLIT_SYNC, ExpertParallelMoE

    init_distributed("cpu")
    torch.manual_seed(0)
    moe = MoEFeedForward(16, MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=8,
                                       shared_expert_intermediate_size=8))
    init_moe_weights(moe, 0.2)
    ep = ExpertParallelMoE(copy.deepcopy(moe), ep_size=1, ep_rank=0)
    ep.ep_group = torch.distributed.group.WORLD
    x_BTD = torch.randn(2, 7, 16)
    valid_BT = torch.ones(2, 7, dtype=torch.bool)
    valid_BT[1, 5:] = False  # padding never reaches the experts
    xa, xb = x_BTD.clone().requires_grad_(), x_BTD.clone().requires_grad_()
    ya, sa = moe(xa, valid_BT)
    with counting() as seen:
        yb, sb = ep(xb, valid_BT)
        (yb.square().sum() + sb.lb_loss + sb.z_loss).backward()
    assert seen == {EP_SPLIT_SYNC: 1}
    (ya.square().sum() + sa.lb_loss + sa.z_loss).backward()
    torch.testing.assert_close(yb, ya, rtol=0, atol=1e-6)
    torch.testing.assert_close(sb.lb_loss, sa.lb_loss, rtol=0, atol=1e-6)
    assert torch.equal(sb.tokens_per_expert, sa.tokens_per_expert)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=1e-6)
    gate_up_grad = torch.cat([ep.experts.w1.grad, ep.experts.w3.grad], -1)  # AutoEP keeps gate and up apart
    torch.testing.assert_close(gate_up_grad, moe.w_gate_up.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(ep.experts.w2.grad, moe.w_down.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(ep.router.weight.grad, moe.router.weight.grad, rtol=0, atol=1e-6)
