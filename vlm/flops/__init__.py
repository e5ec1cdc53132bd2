"""FLOP / parameter / KV-cache accounting (``accountant``) and the FLOP matcher (``matching``)."""
from vlm.flops.accountant import (
    Arch,
    compare_table,
    count_params,
    describe,
    flops_per_token,
    kv_bytes_per_token,
    single_table,
    summary,
)
from vlm.flops.matching import config_to_sections, solve_match, solve_report, write_yaml
from vlm.flops.vlm_tokens import image_tokens_per_image, llm_flops_per_sample, projector_params

__all__ = ["Arch", "compare_table", "config_to_sections", "count_params", "describe", "flops_per_token",
           "image_tokens_per_image", "kv_bytes_per_token", "llm_flops_per_sample", "projector_params", "single_table",
           "solve_match", "solve_report", "summary", "write_yaml"]
