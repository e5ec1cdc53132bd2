"""Expert parallelism: every MoE layer's experts sharded over DeepSpeed's expert-parallel group,
tokens dispatched to the rank holding their expert and combined back with a dropless all-to-all
of variable split sizes (torch's ``all_to_all_single_autograd``, as torchtitan's expert parallelism
uses), in token AND concept layers.

``apply_expert_parallel`` runs before ``deepspeed.initialize`` and swaps each ``MoEFeedForward``
for an ``ExpertParallelMoE`` holding experts [ep_rank * E_local, (ep_rank + 1) * E_local). The
model code stays free of distributed code: the swap happens here, outside it.

Why a subclass of DeepSpeed's ``AutoEPMoELayer`` and not AutoEP's own conversion: AutoEP replaces a
layer with its own router and forward (``forward(hidden_states)``), which has no padding mask and
no load-balance / z losses of ours (it balances with an expert bias); the concept layers and the
losses would change. So the layer keeps our router, padding mask, losses and grouped GEMM, and
adopts AutoEP's LAYER CONTRACT (``experts.w1/w2/w3`` stacked [E_local, ...], ``ep_group_name``,
``num_local_experts``, placement metadata, ``allreduce=False`` + ``group_name`` on expert params):
with it the engine itself creates the expert / expert-data-parallel groups
(``set_deepspeed_parallelism``), reduces expert gradients over the expert-data-parallel group,
partitions them in ZeRO-1/2, and writes / reads one checkpoint file per expert (universal
checkpoint metadata included). ZeRO-3 with expert parallelism is refused (``check_supported``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from vlm.modeling.config_base import fail
from vlm.modeling.moe import MoEFeedForward, combine, grouped_swiglu, sort_by_expert
from vlm.modeling.syncs import host_sync

EP_SPLIT_SYNC = "expert parallel: the all-to-all split sizes (the output shape of each exchange)"


def ep_group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"  # DeepSpeed's naming of expert-parallel groups


def check_supported(cfg, world_size: int, model: nn.Module, zero_stage: int) -> None:
    """One config error line naming each setting expert parallelism cannot serve."""
    n = cfg.parallel.expert_parallel_size
    if n == 1:
        return
    num_experts = max((m.num_experts for m in model.modules() if isinstance(m, MoEFeedForward)), default=0)
    problems = []
    if world_size % n:
        problems.append(f"it must divide the world size {world_size}")
    if num_experts and num_experts % n:
        problems.append(f"it must divide the number of experts {num_experts}")
    if not num_experts:
        problems.append("the model has no routed experts")
    if zero_stage == 3:
        problems.append("ZeRO-3 with expert parallelism is not supported (use zero1 / zero2: experts are "
                        "already sharded, ZeRO-1/2 shards their optimizer state over the expert-data-parallel group)")
    if cfg.train.lora:
        problems.append("train.lora is not supported with expert parallelism")
    if problems:
        raise fail("parallel.expert_parallel_size", f"{n}: " + "; ".join(problems))


def create_groups(ep_size: int) -> str:
    """DeepSpeed's expert-parallel and expert-data-parallel groups (consecutive ranks form an
    expert-parallel group), created now so the experts can be sliced before the engine exists; the
    engine finds and reuses them by name."""
    from deepspeed.utils import groups

    name = ep_group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(expert_parallel_size_=ep_size, mp_size=1, pp_size=1)
    return name


class LocalExperts(nn.Module):
    """This rank's experts, stacked: w1 = gate [E_local, D, I], w3 = up [E_local, D, I], w2 = down
    [E_local, I, D] (AutoEP's names and separate gate / up, as its universal-checkpoint code needs; dim 0
    indexes the local experts). The forward concatenates w1 and w3 for the one gate+up GEMM."""

    def __init__(self, w_gate, w_up, w_down):
        super().__init__()
        self.w1 = nn.Parameter(w_gate.detach().clone(), requires_grad=w_gate.requires_grad)
        self.w3 = nn.Parameter(w_up.detach().clone(), requires_grad=w_up.requires_grad)
        self.w2 = nn.Parameter(w_down.detach().clone(), requires_grad=w_down.requires_grad)


def _autoep_layer_class():
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return AutoEPMoELayer


class ExpertParallelMoE(_autoep_layer_class()):
    """A ``MoEFeedForward`` with sharded experts: same ``forward(x_BTD, valid_BT) -> (y, MoEStats)``,
    same router / shared expert / losses (the methods are ``MoEFeedForward``'s own)."""

    forward = MoEFeedForward.forward_sorted
    route = MoEFeedForward.route
    losses = MoEFeedForward.losses
    _add_shared = MoEFeedForward._add_shared

    def __init__(self, moe: MoEFeedForward, ep_size: int, ep_rank: int):
        from deepspeed.checkpoint.autoep_affine import (autoep_experts_for_rank, autoep_placement_to_affine_map,
                                                        legacy_uniform_autoep_placement_descriptor)
        from deepspeed.checkpoint.constants import (AFFINE_MAP, AUTOEP_EXPERT_PLACEMENT, AUTOEP_PARAM_EP_RANK,
                                                    AUTOEP_PARAM_LOCAL_EXPERTS, AUTOEP_PARAM_LOGICAL_SHAPE,
                                                    DS_AUTOEP_UC_META)
        from deepspeed.module_inject.auto_ep_comm import COMM_BACKEND

        nn.Module.__init__(self)  # AutoEPMoELayer.__init__ builds its own router from an HF spec: not used
        E = moe.num_experts
        self.num_experts, self.top_k, self.norm_topk_prob = E, moe.top_k, moe.norm_topk_prob
        self.ep_size, self.ep_rank, self.num_local_experts = ep_size, ep_rank, E // ep_size
        self.ep_group_name, self.ep_group = ep_group_name(ep_size), None  # the group: set_deepspeed_parallelism
        self.folding_group_handles, self.tp_group = None, None
        self.combine_impl, self.comm_backend = "index_add", COMM_BACKEND
        self.expert_placement_descriptor = legacy_uniform_autoep_placement_descriptor(E, self.num_local_experts,
                                                                                      ep_size)
        self.router, self.shared, self.shared_gate = moe.router, moe.shared, moe.shared_gate
        lo, hi = ep_rank * self.num_local_experts, (ep_rank + 1) * self.num_local_experts
        self.experts = LocalExperts(moe.w_gate[lo:hi], moe.w_up[lo:hi], moe.w_down[lo:hi])
        local = list(autoep_experts_for_rank(self.expert_placement_descriptor, ep_rank))
        for p in self.experts.parameters():
            logical = [E, *p.shape[1:]]
            setattr(p, DS_AUTOEP_UC_META, {
                AUTOEP_EXPERT_PLACEMENT: self.expert_placement_descriptor,
                AFFINE_MAP: autoep_placement_to_affine_map(self.expert_placement_descriptor, logical).to_dict(),
                AUTOEP_PARAM_LOGICAL_SHAPE: logical, AUTOEP_PARAM_EP_RANK: ep_rank,
                AUTOEP_PARAM_LOCAL_EXPERTS: local})
            p.allreduce, p.group_name = False, self.ep_group_name  # DeepSpeed's MoE-parameter convention
            p.ds_zero_placement_family, p.ds_zero_partition_group_name = "autoep_expert", self.ep_group_name
        for p in self.router.parameters():
            p.allreduce = True

    def experts_sorted(self, x_ND, weights_NK, experts_NK, keep_N=None):
        """The dispatch of ``forward``: the assignments sorted by expert (hence by destination rank; padding last, never sent),
        exchanged, regrouped by local expert, run through one grouped SwiGLU, and sent back in the
        reverse exchange; the weighted sum per token is ``MoEFeedForward.experts_sorted``'s."""
        N, K = experts_NK.shape
        E, E_loc, P = self.num_experts, self.num_local_experts, self.ep_size
        _, order_NK, _, counts_E = sort_by_expert(experts_NK, E, keep_N)
        recv_PL = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_PL, counts_E, group=self.ep_group)  # counts per (source rank, local expert)
        recv_PL = recv_PL.view(P, E_loc)
        with host_sync(EP_SPLIT_SYNC):
            send, recv = torch.stack((counts_E.view(P, E_loc).sum(1), recv_PL.sum(1))).tolist()
        n_send, n_recv = sum(send), sum(recv)
        order = order_NK[:n_send]
        token_idx = order // K
        x_recv = all_to_all_single_autograd(x_ND[token_idx], recv, send, self.ep_group)
        # received rows come by source rank, each source's rows by local expert: regroup by expert
        local_e = torch.repeat_interleave(torch.arange(E_loc, device=x_ND.device).repeat(P), recv_PL.reshape(-1),
                                          output_size=n_recv)
        perm = local_e.sort(stable=True).indices
        offs = recv_PL.sum(0).cumsum(0).to(torch.int32)
        w = self.experts
        y_local = grouped_swiglu(x_recv[perm], offs, torch.cat([w.w1, w.w3], -1), w.w2)
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local) if n_recv else y_local
        y_sent = all_to_all_single_autograd(y_recv, send, recv, self.ep_group)
        return combine(y_sent, order_NK, weights_NK).to(x_ND.dtype), counts_E


def apply_expert_parallel(model: nn.Module, ep_size: int) -> int:
    """Swap every ``MoEFeedForward`` for its sharded ``ExpertParallelMoE``; returns how many."""
    from deepspeed.utils import groups

    name = create_groups(ep_size)
    ep_rank = groups._get_expert_parallel_rank(name)
    swaps = [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]
    for path, moe in swaps:
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr,
                ExpertParallelMoE(moe, ep_size, ep_rank))
    return len(swaps)


def is_expert_parallel(module: nn.Module) -> bool:
    return any(isinstance(m, ExpertParallelMoE) for m in module.modules())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over each expert-parallel group: the state dict with every ``ExpertParallelMoE``'s
    experts gathered whole and laid out as in the unsharded model (``w_gate_up`` / ``w_down``)."""
    state = dict(module.state_dict())
    for path, m in module.named_modules():
        if not isinstance(m, ExpertParallelMoE):
            continue
        whole = {}
        for theirs in ("w1", "w3", "w2"):
            local = state.pop(f"{path}.experts.{theirs}").contiguous()
            parts = [torch.empty_like(local) for _ in range(m.ep_size)]
            dist.all_gather(parts, local, group=m.ep_group)
            whole[theirs] = torch.cat(parts)
        state[f"{path}.w_gate_up"] = torch.cat([whole["w1"], whole["w3"]], -1)
        state[f"{path}.w_down"] = whole["w2"]
    return state
