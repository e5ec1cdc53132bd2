"""The reliability suite (``python -m vlm.reliability``, ``make faults``): fault injection into real
2-process training runs (``cases.py`` on ``harness.py``), a soak run (``soak.py``), and the tiny run
configs it shares with the tests (``runs.py``). The fault plan and its points are in ``faults.py``;
``python -m vlm.reliability.train`` is the training entry point that injects them (``train.py``)."""
