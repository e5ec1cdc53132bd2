"""Evaluation of ConceptMoE-VL checkpoints: the lmms-eval model ``conceptmoe_vlm``, offline tasks, ``make eval``
and text perplexity (eval_suites/README.md). Importing this package is cheap (no torch)."""
