"""The planted bugs behind the strengthened tests (a known bug per entry, the test that must catch it): each
plant is written into the tree, its test must fail, the file is restored. From the repository root:

    .venv/bin/python scripts/planted_bugs.py [NAME ...]     # e.g. 14a 16; all when none are named
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# (name, file, the correct line, the planted bug, the test that must fail)
PLANTS = [
 ("14a", "data_pipelines/mixture.py",
  'self.local_consumed = int(state["samples_consumed"]) // self.world_size',
  'self.local_consumed = -(-int(state["samples_consumed"]) // self.world_size)',
  "tests/unit/training/test_reshard.py::test_data_position_maps_with_fewer_than_new_world_repeats"),
 ("14b", "vlm/training/reshard.py",
  'data["seen"] = sum(int(s["data"].get("seen", 0)) for s in states)',
  'data["seen"] = int(data.get("seen", 0))',
  "tests/unit/training/test_reshard.py::test_data_position_maps_with_fewer_than_new_world_repeats"),
 ("17", "vlm/training/metrics.py",
  'out["mean_doc_len"] = c["doc_tokens_sq"] / max(c["tokens"], 1.0)',
  'out["mean_doc_len"] = c["doc_tokens_sq"] / max(c["padded_tokens"], 1.0)',
  "tests/unit/flops/test_mfu.py::test_mean_doc_len_counts_real_tokens_not_padding"),
 ("3", "vlm/flops/training.py",
  "        g_in, g_w = flags[region]\n",
  "        g_in, g_w = True, True\n",
  "tests/unit/flops/test_mfu.py::test_frozen_lm_counts_forward_and_input_gradient"),
 ("15", "vlm/modeling/attention.py",
  "        return torch.where(medium, smoothed, scaled), 1.0",
  "        return torch.where(medium, smoothed, scaled)[[0, 1, 3, 2] + list(range(4, head_dim // 2))], 1.0",
  "tests/unit/convert/test_hf_import.py::test_rope_inverse_frequencies_equal_transformers_buffer"),
 ("16", "vlm/modeling/modeling_conceptmoe_vl.py",
  "class ConceptMoEVLMForConditionalGeneration(ConceptMoEPreTrainedModel, GenerationMixin):\n",
  "class ConceptMoEVLMForConditionalGeneration(ConceptMoEPreTrainedModel, GenerationMixin):\n"
  "    _keys_to_ignore_on_save = ['language_model.model.chunker.q_proj.weight', 'language_model.model.chunker.k_proj.weight']\n",
  "tests/unit/modeling/test_vlm_model.py::test_save_and_load_gives_identical_logits"),
 ("18a", "eval_suites/lmms_plugin.py",
  "pred = logits[b, width - n - 1: width - 1].float()",
  "pred = logits[b, width - n: width].float()",
  "tests/unit/eval_suites/test_eval_loglikelihood.py::test_scores_are_the_log_softmax_at_t_minus_1"),
 ("18b", "vlm/training/peak.py",
  "    # every rank measures at once",
  "    return 32e9 * torch.get_num_threads(), 'a guess'\n    # every rank measures at once",
  "tests/unit/flops/test_mfu.py::test_cpu_mfu_is_against_a_measured_peak_and_never_above_100_percent"),
 ("18c", "vlm/training/metrics.py",
  "        if mfu <= 1.0:\n            return {\"mfu\": mfu}",
  "        if True:\n            return {\"mfu\": mfu}",
  "tests/unit/flops/test_mfu.py::test_cpu_mfu_is_against_a_measured_peak_and_never_above_100_percent"),
 ("18d", "vlm/flops/training.py",
  'return cls(lm=trainable.get("lm", 0) > 0 and not lora,',
  'return cls(lm=True,',
  "tests/unit/flops/test_mfu.py::test_trains_of_the_llava_align_stage"),
 ("33-rng", "vlm/training/trainer.py",
  '        ckpt.set_rng_state(rank_state["rng"])',
  '        # ckpt.set_rng_state(rank_state["rng"])',
  "tests/unit/training/test_checkpoint.py::test_resume_restores_the_rng_states"),
 ("33-rng-default", "vlm/training/trainer.py",
  '        ckpt.set_rng_state(rank_state["rng"])',
  '        # ckpt.set_rng_state(rank_state["rng"])',
  "tests/unit/training/test_resume_exact.py::test_interrupted_and_resumed_run_equals_the_uninterrupted_run"),
 ("33-loader", "data_pipelines/mixture.py",
  "generator=torch.Generator().manual_seed(self.seed), **extra)",
  "generator=torch.Generator().manual_seed(self.seed) if self.num_workers > 0 else None, **extra)",
  "tests/unit/training/test_resume_exact.py::test_interrupted_and_resumed_run_equals_the_uninterrupted_run"),
 ("33-loader-rng", "data_pipelines/mixture.py",
  "generator=torch.Generator().manual_seed(self.seed), **extra)",
  "generator=torch.Generator().manual_seed(self.seed) if self.num_workers > 0 else None, **extra)",
  "tests/unit/data_pipelines/test_data_mixture.py::test_iterating_leaves_the_global_rngs_alone"),
 ("33-loader-2ranks", "data_pipelines/mixture.py",
  "generator=torch.Generator().manual_seed(self.seed), **extra)",
  "generator=torch.Generator().manual_seed(self.seed) if self.num_workers > 0 else None, **extra)",
  "tests/integration/training/test_resume_exact_two_ranks.py::"
  "test_two_ranks_interrupted_and_resumed_equal_the_uninterrupted_steps"),
 ("35-kv", "vlm/modeling/attention.py",
  "        s = self.size\n",
  "        s = int(self.len_B.max())\n",
  "tests/unit/modeling/test_decode_syncs.py::test_generate_reads_at_most_one_per_token"),
 ("35-kv-item", "vlm/modeling/attention.py",
  "        if s >= self.capacity:\n",
  "        if self.len_B.max().item() >= self.capacity:\n",
  "tests/unit/modeling/test_decode_syncs.py::test_plain_decode_step_is_one_graph"),
 # issue 33, part 2: single-line bugs the unit tier did not see
 ("33-quota", "data_pipelines/mixture.py",
  'for k in np.argsort(-(exact - quotas), kind="stable")[: block_size - quotas.sum()]:',
  'for k in np.argsort(exact - quotas, kind="stable")[: block_size - quotas.sum()]:',
  "tests/unit/data_pipelines/test_data_mixture.py::test_block_quotas_give_spare_slots_to_the_largest_remainders"),
 ("33-jsonl", "data_pipelines/jsonl_index.py",
  "                spans.append((pos, pos + len(line)))\n            pos += len(line)",
  "                spans.append((pos, pos + len(line)))\n                pos += len(line)",
  "tests/unit/data_pipelines/test_jsonl_index.py::test_blank_lines_between_valid_records_keep_both_and_their_spans"),
 ("33-accum", "vlm/training/trainer.py",
  "self.engine.backward(out.loss)",
  "self.engine.backward(out.loss / self.cfg.train.grad_accum)",
  "tests/unit/training/test_grad_accum.py::test_accumulated_gradients_equal_one_larger_micro_batch"),
 ("33-order", "vlm/training/callbacks/defaults.py",
  "return [ProfileWindow(), LogWindow(), NonFiniteGuard(), BoundaryPictures(), PeriodicEval(), CheckpointInterval(),",
  "return [ProfileWindow(), LogWindow(), CheckpointInterval(), NonFiniteGuard(), BoundaryPictures(), PeriodicEval(),",
  "tests/unit/training/test_callbacks.py::test_an_aborting_nonfinite_step_on_a_checkpoint_step_is_not_saved"),
 ("33-ep", "vlm/training/expert_parallel.py",
  "send, recv = torch.stack((counts_E.view(P, E_loc).sum(1), recv_PL.sum(1))).tolist()",
  "send, recv = torch.stack((counts_E.view(P, E_loc).sum(1), recv_PL.sum(0))).tolist()",
  "tests/unit/training/test_expert_parallel_dispatch.py::test_dispatch_matches_the_unsharded_layer_in_one_process"),
 ("34-chunk-shape", "vlm/modeling/chunking.py",
  "            M = max(capacity, 1)\n",
  "            M = concept_len(count_B)\n",
  "tests/unit/modeling/test_host_syncs.py::test_packed_training_step_with_a_host_layout_reads_no_concept_count"),
 ("34-moe-item", "vlm/modeling/moe.py",
  "        y_ND, counts_E = self.experts_sorted(x_ND, weights_NK, experts_NK, keep_N)\n",
  "        top_expert = experts_NK.max().item()  # a host read in the MoE's forward\n"
  "        y_ND, counts_E = self.experts_sorted(x_ND, weights_NK, experts_NK, keep_N)\n",
  "tests/unit/training/test_compile_blocks.py::test_one_block_is_one_graph"),
 # issue 35, items 2-3: a host read in the fixed-shape step; the prefill's layouts back on the device
 ("35-static-kv", "vlm/modeling/attention.py",
  "            return self.k, self.v, self.valid_BC\n",
  "            n = int(self.len_B.max()) + 1\n"
  "            return self.k[:, :, :n], self.v[:, :, :n], self.valid_BC[:, :n]\n",
  "tests/unit/modeling/test_decode_graph.py::test_each_phase_graph_has_no_graph_break"),
 ("35-static-kv-sync", "vlm/modeling/attention.py",
  "            return self.k, self.v, self.valid_BC\n",
  "            n = int(self.len_B.max()) + 1\n"
  "            return self.k[:, :, :n], self.v[:, :, :n], self.valid_BC[:, :n]\n",
  "tests/unit/modeling/test_decode_syncs.py::test_decode_step_reads_at_most_the_boundaries"),
 ("35-prefill", "vlm/modeling/conceptmoe.py",
  "        if state is not None and attention_mask is not None and doc_layout is None and segment_ids is None:\n",
  "        if False:\n",
  "tests/unit/modeling/test_decode_syncs.py::test_prefill_reads_only_the_mask_and_the_concept_counts"),
 # issue 34, items 2-3: DeepSpeed's own norm (bool() on the norm tensor per group), its bucket copies on one rank
 ("34-norm-read", "vlm/training/trainer.py",
  "        self.one_norm_read = use_one_norm_read(self.engine.optimizer)\n",
  "        self.one_norm_read = False\n",
  "tests/unit/training/test_zero_norm.py::test_trainer_step_reads_the_device_once_for_the_norm"),
 ("34-contiguous", "vlm/training/distributed.py",
  '        zo["contiguous_gradients"] = False\n',
  '        zo["contiguous_gradients"] = True\n',
  "tests/unit/training/test_one_rank.py::test_backward_launches_no_per_parameter_copy"),
 # issue 39: the ZeRO norm's clip factor, the one-rank skip with fp32 gradient buffers, the overflow patch without
 # a global norm, the DeepSpeed check (ds_compat.py) and fp32's per-partition check where the norm cannot skip
 ("39-clip-factor", "vlm/training/zero_norm.py",
  "        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), optimizer.clip_grad))\n",
  "        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), optimizer.clip_grad * 1.01))\n",
  "tests/unit/training/test_zero_norm.py::test_clipped_gradients_equal_deepspeeds_above_max_norm"),
 ("39-no-clip", "vlm/training/zero_norm.py",
  "        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), optimizer.clip_grad))\n",
  "        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), 0.0))\n",
  "tests/unit/training/test_zero_norm.py::test_clipped_gradients_equal_deepspeeds_above_max_norm"),
 ("39-combined-scale", "vlm/training/clip_scale.py",
  "    return max(1.0, (norm / loss_scale + 1e-6) / clip_grad) * loss_scale\n",
  "    return max(1.0, (norm / loss_scale + 1e-6) / clip_grad * 1.01) * loss_scale\n",
  "tests/unit/training/test_zero_norm.py::test_clipped_gradients_equal_deepspeeds_above_max_norm"),
 ("39-one-rank-outputs", "vlm/training/one_rank.py",
  "        if dist.get_world_size(group=group) == 1 and all(out is None for out in output_bucket or ()):\n",
  "        if dist.get_world_size(group=group) == 1:\n",
  "tests/unit/training/test_one_rank.py::test_reduction_into_partition_buffers_is_deepspeeds"),
 ("39-overflow-no-norm", "vlm/training/overflow.py",
  "    if not (optimizer.compute_grad_norm and optimizer.check_grad_overflow) or optimizer.cpu_offload:\n",
  "    if not optimizer.check_grad_overflow or optimizer.cpu_offload:\n",
  "tests/unit/training/test_ds_compat.py::test_overflow_patch_keeps_the_only_nan_check_without_a_global_norm[bf16-False]"),
 ("39-skip-probe", "vlm/training/ds_compat.py",
  "        if got is not want:\n",
  "        if False:\n",
  "tests/unit/training/test_ds_compat.py::test_simulated_upgrade_falls_back_with_one_line_and_skips_the_nan_step[skip_gone-bf16]"),
 ("39-fp32-partition-check", "vlm/training/overflow.py",
  "    optimizer.check_grad_overflow = True\n",
  "    pass\n",
  "tests/unit/training/test_ds_compat.py::test_overflow_patch_keeps_the_only_nan_check_without_a_global_norm[fp32-False]"),
 # issue 39 item 6: tests that could not fail, and the weak areas of finding 6
 ("39-num-concepts", "vlm/modeling/conceptmoe.py",
  "out.num_concepts_B = b_BT, p_BT, con.count_B\n",
  "out.num_concepts_B = b_BT, p_BT, torch.full_like(con.count_B, con.valid_BM.shape[1])\n",
  "tests/unit/modeling/test_concept_capacity.py::test_padded_rows_with_capacity_equal_reading_the_count"),
 ("39-prefill-capacity", "vlm/modeling/conceptmoe.py",
  "return None if state is not None else concept_capacity(T, doc_layout is not None, device, self.cfg.runtime)",
  "return concept_capacity(T, doc_layout is not None, device, self.cfg.runtime)",
  "tests/unit/modeling/test_concept_capacity.py::test_generation_reads_the_count_and_equals_the_forward_at_capacity_t"),
 ("39-scan-block-carry", "vlm/modeling/linear_scan_triton.py",
  "        S += tl.exp(tl.cumsum(dec, 0))[:, None] * s[None, :]\n",
  "",
  "tests/unit/modeling/test_linear_scan.py::TestTritonInterpreted::test_slow_decay_carried_across_the_carry_blocks"),
 ("39-scan-block-decay", "vlm/modeling/linear_scan_triton.py",
  "        S += tl.exp(tl.cumsum(dec, 0))[:, None] * s[None, :]\n",
  "        S += tl.exp(tl.cumsum(dec, 0) - dec)[:, None] * s[None, :]\n",
  "tests/unit/modeling/test_linear_scan.py::TestTritonInterpreted::test_slow_decay_carried_across_the_carry_blocks"),
 ("39-samples-rows", "vlm/training/metrics.py",
  'c["samples"] = float(batch.get("num_samples", len(valid)))',
  'c["samples"] = float(len(valid))',
  "tests/unit/flops/test_mfu.py::test_samples_per_s_counts_the_packed_documents_not_the_rows"),
 ("39-profile-start", "vlm/training/callbacks/profile_window.py",
  "and r[0] <= trainer.step + 1 <= r[1]:",
  "and r[0] < trainer.step + 1 <= r[1]:",
  "tests/unit/training/test_gpu_mfu_config.py::test_profile_window_holds_exactly_its_steps"),
 ("39-profile-start-early", "vlm/training/callbacks/profile_window.py",
  "and r[0] <= trainer.step + 1 <= r[1]:",
  "and r[0] - 1 <= trainer.step + 1 <= r[1]:",
  "tests/unit/training/test_gpu_mfu_config.py::test_profile_window_holds_exactly_its_steps"),
 ("39-profile-resume", "vlm/training/callbacks/profile_window.py",
  "and r[0] <= trainer.step + 1 <= r[1]:",
  "and trainer.step + 1 == r[0]:",
  "tests/unit/training/test_gpu_mfu_config.py::test_a_run_resumed_inside_the_window_profiles_the_rest_of_it"),
 # issue 39 item 1: a gradient scale off by 1e-4 on ZeRO-2 only (AdamW all but blind to it): ZeRO-1 and ZeRO-2
 # must be equal bit for bit without accumulation
 ("39-zero2-scale", "vlm/training/zero_norm.py",
  "        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), optimizer.clip_grad))\n",
  "        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), optimizer.clip_grad)\n"
  "                   * (1.0001 if optimizer.partition_gradients else 1.0))\n",
  "tests/integration/training/test_train.py::test_zero1_and_zero2_are_bit_equal_without_accumulation"),
 ("39-resume-fresh", "vlm/training/checkpoint_paths.py",
  '        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint in that folder")',
  "        return None",
  "tests/unit/training/test_cli.py::test_bad_input_is_one_line_before_deepspeed_and_the_model"),
 ("39-resume-fresh-unit", "vlm/training/checkpoint_paths.py",
  '        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint in that folder")',
  "        return None",
  "tests/unit/training/test_checkpoint.py::test_resume_from_a_folder_without_a_complete_checkpoint_is_refused"),
]


def main() -> int:
    only = set(sys.argv[1:])
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    rows = []
    for name, path, old, new, test in PLANTS:
        if only and name not in only:
            continue
        f = Path(path); text = f.read_text()
        if text.count(old) != 1:
            sys.exit(f"plant {name}: the planted line is not in {path} exactly once (the code moved): update the plant")
        f.write_text(text.replace(old, new))
        try:
            r = subprocess.run([".venv/bin/python", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test],
                               env=env, capture_output=True, text=True, timeout=1200)
        finally:
            f.write_text(text)
        line = next((l for l in r.stdout.splitlines() if l.startswith("FAILED") or l.startswith("E ")), "")
        status = "caught" if r.returncode == 1 else f"NOT CAUGHT (rc={r.returncode})"
        rows.append((name, path, test.split("::")[-1], status, line.strip()[:150]))
        print(f"{name:4s} {status:12s} {path} -> {test}\n      {line.strip()[:160]}", flush=True)
    caught = sum(r[3] == "caught" for r in rows)
    print("caught", caught, "of", len(rows))
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
