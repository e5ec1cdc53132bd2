"""The training loop: DeepSpeed engine (ZeRO-1/2/3), stages, logging, atomic checkpoints, export.

One optimizer step = ``train.grad_accum`` micro-batches per rank; DeepSpeed scales the loss by
1/grad_accum, reduces gradients across ranks, clips (``gradient_clipping``), steps the torch AdamW
and then the LambdaLR. ``self.step`` counts optimizer steps taken or skipped (= ``engine.global_steps``).

Non-finite handling: a non-finite loss makes the gradients non-finite; DeepSpeed's ZeRO optimizer
then sees an invalid global gradient norm (all-reduced, so every rank agrees), skips the update,
zeroes the gradients and does not advance the LR schedule (``engine.skipped_steps``). We count
such steps (also those with a finite loss but a non-finite gradient), log them, and abort with
``NonFiniteAbort`` after ``train.max_nonfinite_in_row`` in a row -- before any further checkpoint
is written, so the last good checkpoint stays the newest one.

ZeRO-3: ``MoEFeedForward`` is registered as a leaf module (``set_z3_leaf_modules``): all its expert
weights are gathered when the block runs, so ranks whose tokens routed to different experts still
issue identical all-gathers (no desynchronised collectives, no hang). The vision tower is a leaf
too (timm ViTs use their own position / class tokens outside a submodule's forward), and the
chunker's W_q / W_k, which ``ConceptMoEModel`` reads directly, are registered as external
parameters of the causal-LM wrapper (see ``register_zero3_external``).
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from vlm.training import checkpoint as ckpt
from vlm.training import finish, optim, periodic
from vlm.training.data import (
    build_loader,
    build_model,
    build_model_config,
    build_processor,
    init_weights_from,
    load_tokenizer,
    text_config_of,
)
from vlm.training.distributed import (
    barrier,
    build_ds_config,
    init_distributed,
    resolve_device,
)
from vlm.training.metrics import (
    MetricsLogger,
    WindowStats,
    guess_peak_flops,
    process_health,
    summarize,
    train_flops_per_token,
)
from vlm.training.train_config import TrainConfig
from vlm.training.zero3 import prepare_zero3, register_zero3_external


class NonFiniteAbort(RuntimeError):
    """Too many non-finite steps in a row."""


class DataExhausted(RuntimeError):
    pass


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: str | None = None):
        self.cfg = cfg
        self.t_start = time.time()
        self.device = resolve_device(cfg.device)
        info = init_distributed(self.device, timeout_s=cfg.dist_timeout_s, cpu_threads=cfg.cpu_threads)
        self.rank, self.world_size, self.local_rank = info["rank"], info["world_size"], info["local_rank"]
        self.is_main = self.rank == 0
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device == "cuda")
        if self.bf16 and self.device == "cpu":
            self.print("[train] precision bf16 asked for on CPU: using it (slow); precision: auto gives fp32")
        self.run_dir = cfg.run_dir
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "train_config.json", "w", encoding="utf-8") as f:
                json.dump(cfg.to_dict(), f, indent=1)
        # model (identical on every rank: same seed), then per-rank randomness
        seed_everything(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.model_config = build_model_config(cfg, self.tokenizer)
        model = build_model(self.model_config, cfg.model.kind)
        if cfg.model.init_from:
            init_weights_from(model, cfg.model.init_from, cfg.model.kind)
        self.text_config = text_config_of(self.model_config)
        self.image_token_id = getattr(self.model_config, "image_token_id", None)
        self.processor = build_processor(model, self.tokenizer)
        self.trainable = optim.trainable_parts(cfg)
        self.trainable_counts = optim.apply_freeze(model, self.trainable)
        self.total_counts = optim.count_params(model)
        seed_everything(cfg.seed * 1000 + 1 + self.rank)
        import deepspeed

        self.ds_config = build_ds_config(cfg, self.world_size, self.bf16)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        if self.zero_stage == 3:
            prepare_zero3(model)
        if self.zero_stage == 0:
            self.print("[train] warning: ZeRO stage 0 in fp32 does not skip non-finite steps; use zero1/2/3")
        optimizer = optim.build_optimizer(model, cfg)
        self.group_names = [g["name"] for g in optimizer.param_groups]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=optim.scheduler_factory(cfg), config=self.ds_config)
        if self.zero_stage == 3:
            register_zero3_external(self.engine.module)
        self.model_device = self.engine.device
        self.loader = build_loader(cfg, self.engine.module, self.model_config, self.tokenizer, self.processor,
                                   self.rank, self.world_size)
        # counters
        self.step = 0
        self.skipped_steps = 0
        self.nonfinite_in_row = 0
        self.tokens_seen = 0
        self.train_time_s = 0.0
        self.last_record: dict = {}
        self.resumed_from = None
        path = ckpt.resolve_resume(resume, cfg.ckpt_dir)
        if resume == "auto" and path is None:
            self.print(f"[train] --resume auto: no complete checkpoint in {cfg.ckpt_dir}, starting fresh")
        if path is not None:
            self._load(path)
        elif self.is_main:
            self._set_aside_previous_run()
        barrier()
        self.stop_step = cfg.train.stop_at_step or cfg.train.max_steps
        self.peak_flops = cfg.log.peak_flops or guess_peak_flops(self.device)
        self.logger = MetricsLogger(self.run_dir, self.is_main, cfg.train.max_steps, self.step, cfg.log.progress_bar,
                                    cfg.log.tensorboard, cfg.log.jsonl)
        self._describe()

    # --- helpers --------------------------------------------------------------------------------
    def print(self, text: str) -> None:
        if self.is_main:
            logger = getattr(self, "logger", None)
            if logger is not None:
                logger.write(text)
            else:
                print(text, flush=True)

    def _set_aside_previous_run(self) -> None:
        """A fresh start in a run folder that already holds checkpoints / metrics (e.g. `make
        train-vlm` twice): move them to ckpt.previous / metrics.previous.jsonl (one generation is
        kept) so that ``--resume auto`` can never pick up a stale checkpoint of the earlier run."""
        import shutil

        ck = Path(self.cfg.ckpt_dir)
        if ck.is_dir() and (ckpt.list_checkpoints(ck) or any(ck.glob("step_*"))):
            prev = ck.with_name(ck.name + ".previous")
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(ck, prev)
            self.print(f"[train] fresh start: moved the earlier checkpoints to {prev} (use --resume auto to continue)")
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file():
            os.replace(metrics, self.run_dir / "metrics.previous.jsonl")

    def _describe(self) -> None:
        c = self.cfg
        tc = self.text_config
        lines = [(f"[train] run {c.name}: {c.model.kind} {c.model.preset}, stage {c.train.stage}, "
                  f"{c.deepspeed} (ZeRO-{self.zero_stage}), {'bf16' if self.bf16 else 'fp32'} on {self.device}, "
                  f"world size {self.world_size}"),
                 "[train] params (total / trainable): " + ", ".join(
                     f"{p} {self.total_counts[p]:,}/{self.trainable_counts[p]:,}" for p in optim.PARTS
                     if self.total_counts[p]),
                 (f"[train] text model: d={tc.hidden_size} L={tc.num_hidden_layers} E={tc.num_experts} "
                  f"top{tc.top_k} chunking={tc.chunking}" + (f" R={tc.target_ratio}" if tc.chunking else "")),
                 (f"[train] steps {self.step} -> {self.stop_step} (schedule over {c.train.max_steps}), "
                  f"micro-batch {c.train.micro_batch_size} x accum {c.train.grad_accum} x {self.world_size} ranks")]
        if self.resumed_from:
            lines.append(f"[train] resumed from {self.resumed_from}")
        for line in lines:
            self.print(line)

    def _inputs(self, batch: dict) -> dict:
        dev = self.model_device
        inputs = {k: batch[k].to(dev) for k in ("input_ids", "attention_mask", "position_ids", "labels",
                                                   "segment_ids") if batch.get(k) is not None}
        if self.cfg.model.kind == "vlm":
            pix = batch.get("pixel_values")
            if pix is not None:
                pix = pix.to(dev, dtype=torch.bfloat16 if self.bf16 else torch.float32)
            inputs["pixel_values"] = pix
        return inputs

    def _next_batch(self) -> dict:
        try:
            return next(self.data_iter)
        except StopIteration:
            raise DataExhausted("the data loader is exhausted (data.num_samples reached)") from None

    # --- checkpoints ----------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "nonfinite_in_row": self.nonfinite_in_row,
                "tokens_seen": self.tokens_seen, "train_time_s": self.train_time_s,
                "deepspeed": self.cfg.deepspeed, "zero_stage": self.zero_stage, "config": self.cfg.to_dict(),
                "last_metrics": {k: v for k, v in self.last_record.items() if k != "expert_load"}}

    def save_checkpoint(self) -> Path:
        rank_state = {"rng": ckpt.rng_state(), "data": self.loader.state_dict()}
        path = ckpt.save(self.engine, self.cfg.ckpt_dir, self.step, self._trainer_state(), rank_state,
                         keep_last=self.cfg.checkpoint.keep_last, rank=self.rank, world_size=self.world_size)
        self.last_saved_step = self.step
        self.print(f"[train] checkpoint step {self.step} -> {path}")
        return path

    def _load(self, path: Path) -> None:
        trainer_state, rank_state = ckpt.load(self.engine, path, self.rank, self.world_size)
        self.step = int(trainer_state["step"])
        if self.engine.global_steps != self.step:
            self.engine.global_steps = self.step
        self.skipped_steps = int(trainer_state.get("skipped_steps", 0))
        self.nonfinite_in_row = int(trainer_state.get("nonfinite_in_row", 0))
        self.tokens_seen = int(trainer_state.get("tokens_seen", 0))
        self.train_time_s = float(trainer_state.get("train_time_s", 0.0))
        self.loader.load_state_dict(rank_state["data"])
        ckpt.set_rng_state(rank_state["rng"])
        self.resumed_from = str(path)
        self.last_saved_step = self.step

    # --- training -------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        self.engine.train()
        self.data_iter = iter(self.loader)
        window = WindowStats(self.image_token_id)
        window_steps = 0
        exhausted = False
        self.last_saved_step = getattr(self, "last_saved_step", None)
        faults = {int(s) for s in cfg.train.fault_nonfinite_steps}
        t_loop = time.perf_counter()
        try:
            while self.step < self.stop_step:
                nonfinite_before = window.nonfinite if self.skipped_steps or faults else 0.0
                skipped_before = self.engine.skipped_steps
                try:
                    for _ in range(cfg.train.grad_accum):
                        batch = self._next_batch()
                        out = self.engine(**self._inputs(batch))
                        loss = out.loss
                        if self.step + 1 in faults:
                            loss = loss * float("nan")
                            out.loss = loss
                        window.add(out, batch)
                        self.engine.backward(loss)
                        self.engine.step()
                except DataExhausted as err:
                    self.print(f"[train] stopping at step {self.step}: {err}")
                    exhausted = True
                    break
                self.step += 1
                window_steps += 1
                skipped = self.engine.skipped_steps - skipped_before > 0 or not getattr(self.engine, "_step_applied", True)
                if skipped:
                    self.skipped_steps += 1
                    self.nonfinite_in_row += 1
                    gn = self.engine.get_global_grad_norm()
                    what = "loss" if window.nonfinite > nonfinite_before else "gradient"
                    self.print(f"[train] step {self.step}: non-finite {what} (grad norm {gn}), step skipped "
                               f"({self.nonfinite_in_row} in a row, {self.skipped_steps} total)")
                else:
                    self.nonfinite_in_row = 0
                self.logger.advance()
                last = self.step >= self.stop_step
                if self.step % cfg.log.every_steps == 0 or last or skipped:
                    elapsed = time.perf_counter() - t_loop
                    self._log_window(window, elapsed, window_steps)
                    self.train_time_s += elapsed
                    window.reset()
                    window_steps = 0
                    t_loop = time.perf_counter()
                if self.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
                    msg = (f"aborting: {self.nonfinite_in_row} non-finite steps in a row (train.max_nonfinite_in_row="
                           f"{cfg.train.max_nonfinite_in_row}) at step {self.step}; the last good checkpoint is "
                           f"{ckpt.find_checkpoint(cfg.ckpt_dir) or 'none'} (left untouched)")
                    self.print(f"[train] {msg}")
                    raise NonFiniteAbort(msg)
                if cfg.log.visualize_every and self.step % cfg.log.visualize_every == 0:
                    periodic.boundary_picture(self)
                if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0 and not last:
                    periodic.periodic_vqa(self)
                if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0 and not last:
                    self.save_checkpoint()
            if window.micro and not exhausted:
                elapsed = time.perf_counter() - t_loop
                self._log_window(window, elapsed, window_steps)
                self.train_time_s += elapsed
            if cfg.checkpoint.save_final and self.last_saved_step != self.step:
                self.save_checkpoint()
        finally:
            self.logger.close()
        return {"step": self.step, "skipped_steps": self.skipped_steps, "last": self.last_record}

    def _log_window(self, window: WindowStats, elapsed: float, steps: int) -> None:
        red = window.reduce()  # collective
        skipped_samples = self._skipped_samples()  # collective
        rec = {"step": self.step, **summarize(red, elapsed, self.world_size)}
        self.tokens_seen += rec["tokens"]
        lrs = self.engine.get_lr()
        rec["lr"] = float(lrs[0]) if lrs else None
        rec["lr_groups"] = {n: float(lr) for n, lr in zip(self.group_names, lrs)}
        gn = self.engine.get_global_grad_norm()
        rec["grad_norm"] = float(gn) if gn is not None else None
        rec["skipped_steps"] = self.skipped_steps
        rec["nonfinite_in_row"] = self.nonfinite_in_row
        rec["skipped_samples"] = skipped_samples
        rec["tokens_seen"] = self.tokens_seen
        fpt = train_flops_per_token(self.text_config, rec["mean_row_len"], rec.get("ratio"))
        if fpt is not None:
            rec["flops_per_token"] = fpt
            rec["mfu"] = rec["tokens_per_s"] * fpt / (self.peak_flops * self.world_size)
        rec["time_s"] = round(time.time() - self.t_start, 3)
        rec.update(process_health())
        self.last_record = rec
        self.logger.log(rec)

    def _skipped_samples(self) -> dict:
        local = dict(getattr(self.loader, "bad_counts", {}) or {})
        if self.world_size > 1:
            gathered = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, local)
        else:
            gathered = [local]
        total: dict = {}
        for d in gathered:
            for k, v in (d or {}).items():
                total[k] = total.get(k, 0) + int(v)
        return total

    # --- after training (vlm/training/finish.py) -------------------------------------------------
    def finish(self) -> dict:
        """Export (if asked), eval (if configured), summary table. Collective."""
        return finish.finish(self)

    def export_hf(self) -> Path | None:
        return finish.export_hf(self)

    def close(self) -> None:
        self.logger.close()
