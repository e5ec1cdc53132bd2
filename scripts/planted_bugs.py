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
  "tests/integration/training/test_resume_world_size.py::test_data_position_maps_with_fewer_than_new_world_repeats"),
 ("14b", "vlm/training/reshard.py",
  'data["seen"] = sum(int(s["data"].get("seen", 0)) for s in states)',
  'data["seen"] = int(data.get("seen", 0))',
  "tests/integration/training/test_resume_world_size.py::test_data_position_maps_with_fewer_than_new_world_repeats"),
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
 ("34-moe-item", "vlm/modeling/moe.py",
  "        y_ND, counts_E = self.experts_sorted(x_ND, weights_NK, experts_NK, keep_N)\n",
  "        top_expert = experts_NK.max().item()  # a host read in the MoE's forward\n"
  "        y_ND, counts_E = self.experts_sorted(x_ND, weights_NK, experts_NK, keep_N)\n",
  "tests/unit/training/test_compile_blocks.py::test_one_block_is_one_graph"),
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
