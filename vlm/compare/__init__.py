"""The controlled MoE vs ConceptMoE comparison (paper sections 7-8): ``config`` (the compare YAML),
``presets`` (FLOP-matched arms), ``jobs`` (training + held-out eval per arm and seed), ``report``,
``cli`` (``python -m vlm.compare``)."""
