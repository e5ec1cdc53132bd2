"""The model package, in the transformers layout: configs, models, processor, image processor, vision
towers, projector, chat template. An export carries these files as its code (``save_pretrained`` copies
them, ``auto_map`` names them), so the package is flat, imports itself only relatively (``from .x import``)
and nothing of ours from outside; training, data and evaluation import it, never the reverse."""
