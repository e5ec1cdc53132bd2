"""Evaluation of ConceptMoE-VL checkpoints.

* ``eval_suites.lmms_plugin``  - the ``conceptmoe_vlm`` model for lmms-eval (entry point group
  ``lmms_eval.models``), plus a version-gated fix for lmms-eval 0.7.x's handling of
  loglikelihood results.
* ``eval_suites.tasks``        - offline lmms-eval tasks ``cmoe_digits_vqa`` / ``cmoe_digits_mc``
  (``--include_path eval_suites/tasks``), read from parquet files made by
  ``python -m eval_suites.build_tasks``.
* ``eval_suites.run``          - ``make eval``: runs the real lmms-eval CLI in a subprocess and
  fails loudly when it produced no results.
* ``eval_suites.text_eval``    - perplexity / bits per byte and the achieved compression ratio on
  held-out text.

Importing this package is cheap (no torch); each module imports what it needs.
"""
