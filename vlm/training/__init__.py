"""Training system of ConceptMoE-VL (DeepSpeed engine in every mode; see ``vlm/train.py``).

Modules:
    train_config  the training YAML as dataclasses, dotted overrides, one-line errors
    distributed   process-group setup (gloo on CPU, nccl on GPU), DeepSpeed config assembly
    optim         model parts, stage freezing, parameter groups, warmup + cosine schedule
    data          tokenizer / processor / loaders (the real mixture and a synthetic one)
    checkpoint    atomic DeepSpeed checkpoints + loader and RNG state, ``latest`` pointer
    metrics       metric accumulation, tqdm / TensorBoard / JSONL logging
    trainer       the training loop
    vqa_eval      held-out digits VQA accuracy by greedy generation

Nothing heavy is imported here: ``import vlm.training.train_config`` stays cheap.
"""
