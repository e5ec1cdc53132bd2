"""Training system of ConceptMoE-VL (DeepSpeed engine in every mode; entry point ``vlm/train.py``,
the loop in ``trainer.py``). Nothing heavy is imported here, so importing a submodule stays cheap."""
