"""The training loop: a DeepSpeed engine (ZeRO-1/2/3) over the model, the data loader, metric
logging, atomic checkpoints and exact resume; ``finish.py`` does the export / eval afterwards."""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from vlm.config.train import TrainConfig
from vlm.training import checkpoint as ckpt
from vlm.training import lora, optim, reshard
from vlm.training.callbacks import end_of_run as finish, in_training_eval as periodic
from vlm.training.data import build_loader, check_data_paths
from vlm.training.distributed import (
    barrier,
    build_ds_config,
    init_distributed,
    resolve_device,
)
from vlm.training.expert_parallel import apply_expert_parallel, check_supported
from vlm.flops.training import Trains
from vlm.reliability.faults import Faults
from vlm.modeling.hf import loss_only
from vlm.training.activation_checkpointing import apply_activation_checkpointing
from vlm.training.compile import compile_blocks
from vlm.training.build import build_processor, setup_model, text_config_of
from vlm.training.metrics import (
    MetricsLogger,
    WindowStats,
    MfuMeter,
    process_health,
    summarize,
    train_flops_per_token,
)
from vlm.training.peak import resolve_peak
from vlm.training.state import Progress, RunContext
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
    """Build everything for ``cfg`` (collective), resume from ``resume`` (``auto`` or a path), then
    ``fit()`` and ``finish()``. ``faults``: the fault plan (default: ``VLM_TRAIN_FAULT``, read here once)."""

    def __init__(self, cfg: TrainConfig, resume: str | None = None, faults: Faults | None = None):
        self.cfg = cfg
        check_data_paths(cfg)  # a missing file is one line now, not after the model is built
        self.logger: MetricsLogger | None = None
        if faults is None:
            faults = Faults.from_env()
        self.faults = faults
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
        setup = setup_model(cfg, self.print)
        self.tokenizer, self.model_config, model = setup.tokenizer, setup.model_config, setup.model
        self.text_config = text_config_of(self.model_config)
        self.image_token_id = getattr(self.model_config, "image_token_id", None)
        self.processor = build_processor(model, self.tokenizer)
        self.trainable = optim.trainable_parts(cfg)
        self.trainable_counts = (lora.apply(model, cfg, self.trainable, self.print) if cfg.train.lora
                                 else optim.apply_freeze(model, self.trainable))  # train.lora: adapters on the LM
        loss_only(model)  # training reads the losses and boundaries, never logits: chunked CE, no [B, T, V]
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)  # recompute in the backward
        if cfg.train.compile:
            n = compile_blocks(model, torch.bfloat16 if self.bf16 else torch.float32)
            self.print(f"[train] train.compile: {n} transformer blocks compiled (torch.compile)")
        self.total_counts = optim.count_params(model)
        seed_everything(cfg.seed * 1000 + 1 + self.rank)
        import deepspeed

        self.ds_config = build_ds_config(cfg, self.world_size, self.bf16)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        # another world size: the checkpoint is converted once to DeepSpeed's universal format here (reshard.py)
        self.resume_path = ckpt.resolve_resume(resume, cfg.ckpt_dir)
        self.universal = reshard.prepare(self.resume_path, self.world_size, self.zero_stage, self.ds_config,
                                         self.rank, self.print, cfg.parallel.expert_parallel_size)
        if self.zero_stage == 3:
            prepare_zero3(model)
        if self.zero_stage == 0:
            self.print("[train] warning: ZeRO stage 0 in fp32 does not skip non-finite steps; use zero1/2/3")
        self.ep_size = cfg.parallel.expert_parallel_size
        if self.ep_size > 1:
            check_supported(cfg, self.world_size, model, self.zero_stage)
            n = apply_expert_parallel(model, self.ep_size)
            self.print(f"[train] expert parallelism: the experts of {n} MoE layers sharded over groups of "
                       f"{self.ep_size} ranks (dropless all-to-all)")
        optimizer = optim.build_optimizer(model, cfg)
        self.group_names = [g["name"] for g in optimizer.param_groups]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=optim.scheduler_factory(cfg), config=self.ds_config)
        if self.zero_stage == 3:
            register_zero3_external(self.engine.module)
        self.ctx = RunContext(cfg=cfg, run_dir=self.run_dir, is_main=self.is_main, zero_stage=self.zero_stage,
                              device=self.device, model_device=self.engine.device, module=self.engine.module,
                              model_config=self.model_config, processor=self.processor, tokenizer=self.tokenizer,
                              say=self.print)
        self.loader = build_loader(cfg, self.engine.module, self.model_config, self.tokenizer, self.processor,
                                   self.rank, self.world_size)
        if self.is_main and hasattr(self.loader, "report"):  # the first bad records of each reason, one line each
            self.loader.report = self.print
        self.progress = Progress()
        self.resumed_from: str | None = None
        self.last_saved_step: int | None = None
        path = self.resume_path
        if resume == "auto" and path is None:
            self.print(f"[train] --resume auto: no complete checkpoint in {cfg.ckpt_dir}, starting fresh")
        if path is not None:
            self._load(path)
        elif self.is_main:
            self._set_aside_previous_run()
        barrier()
        self.stop_step = cfg.train.stop_at_step or cfg.train.max_steps
        self.peak_flops, peak_source = resolve_peak(cfg.log.peak_flops, self.device,
                                                    torch.bfloat16 if self.bf16 else torch.float32)
        self.peak_label = f"{self.peak_flops:.3g} FLOP/s/device ({peak_source})"
        self.mfu = MfuMeter(self.peak_flops, self.world_size, self.peak_label, self.print)
        self.trains = Trains.of_counts(self.trainable_counts, lora=cfg.train.lora is not None)
        self.logger = MetricsLogger(self.run_dir, self.is_main, cfg.train.max_steps, self.step, cfg.log.progress_bar,
                                    cfg.log.sinks, cfg.name, cfg.to_dict())
        self._describe()

    # read-only views for callers (vlm/train.py, vlm/compare/jobs.py, tests)
    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def last_record(self) -> dict:
        return self.progress.last_record

    # --- helpers --------------------------------------------------------------------------------
    def print(self, text: str) -> None:
        if self.is_main:
            if self.logger is not None:
                self.logger.write(text)
            else:
                print(text, flush=True)

    def _set_aside_previous_run(self) -> None:
        """A fresh start in a run folder that already holds checkpoints / metrics / an export (e.g.
        `make train-vlm` twice): move them to ckpt.previous / metrics.previous.jsonl / hf.previous (one
        generation is kept) so that ``--resume auto`` can never pick up a stale checkpoint of the
        earlier run, and its export is neither overwritten nor taken for this run's."""
        import shutil

        ck = Path(self.cfg.ckpt_dir)
        if ck.is_dir() and (ckpt.list_checkpoints(ck) or any(ck.glob("step_*"))):
            prev = ck.with_name(ck.name + ".previous")
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(ck, prev)
            self.print(f"[train] fresh start: moved the earlier checkpoints to {prev} (use --resume auto to continue)")
        hf = self.run_dir / "hf"
        if hf.is_dir():
            prev = hf.with_name("hf.previous")
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(hf, prev)
            self.print(f"[train] fresh start: moved the earlier run's Hugging Face export to {prev}")
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file():
            os.replace(metrics, self.run_dir / "metrics.previous.jsonl")

    def _describe(self) -> None:
        c = self.cfg
        tc = self.text_config
        source = c.model.preset or f"the architecture of {c.model.init_from}"
        source += f" + llm {c.model.llm}" if c.model.llm else ""
        lines = [(f"[train] run {c.name}: {c.model.kind} {source}, stage {c.train.stage}, "
                  f"{c.deepspeed} (ZeRO-{self.zero_stage}), {'bf16' if self.bf16 else 'fp32'} on {self.device}, "
                  f"world size {self.world_size}"),
                 "[train] params (total / trainable): " + ", ".join(
                     f"{p} {self.total_counts[p]:,}/{self.trainable_counts[p]:,}" for p in optim.PARTS
                     if self.total_counts[p]),
                 (f"[train] text model: d={tc.hidden_size} L={tc.num_hidden_layers} E={tc.num_experts} "
                  f"top{tc.top_k} chunking={tc.chunking}" + (f" R={tc.target_ratio}" if tc.chunking else "")),
                 (f"[train] steps {self.step} -> {self.stop_step} (schedule over {c.train.max_steps}), "
                  f"micro-batch {c.train.micro_batch_size} x accum {c.train.grad_accum} x {self.world_size} ranks"),
                 f"[train] MFU against {self.peak_label}; LM training FLOPs: {self.trains.describe()}"]
        if self.resumed_from:
            lines.append(f"[train] resumed from {self.resumed_from}")
        for line in lines:
            self.print(line)

    def _inputs(self, batch: dict) -> dict:
        dev = self.ctx.model_device
        inputs = {k: batch[k].to(dev) for k in ("input_ids", "attention_mask", "position_ids", "labels",
                                                   "segment_ids") if batch.get(k) is not None}
        if self.cfg.model.kind == "vlm":
            pix = batch.get("pixel_values")
            if pix is not None:
                pix = pix.to(dev, dtype=torch.bfloat16 if self.bf16 else torch.float32)
            inputs["pixel_values"] = pix
        return inputs

    @staticmethod
    def _next_batch(data_iter) -> dict:
        try:
            return next(data_iter)
        except StopIteration:
            raise DataExhausted("the data loader is exhausted (data.num_samples reached)") from None

    # --- checkpoints ----------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {**self.progress.counters(), "deepspeed": self.cfg.deepspeed, "zero_stage": self.zero_stage,
                "config": self.cfg.to_dict(), "last_metrics": self.progress.last_metrics()}

    def save_checkpoint(self) -> Path:
        rank_state = {"rng": ckpt.rng_state(), "data": self.loader.state_dict()}
        path = ckpt.save(self.engine, self.cfg.ckpt_dir, self.step, self._trainer_state(), rank_state,
                         keep_last=self.cfg.checkpoint.keep_last, rank=self.rank, world_size=self.world_size,
                         faults=self.faults)
        self.last_saved_step = self.step
        self.print(f"[train] checkpoint step {self.step} -> {path}")
        return path

    def _load(self, path: Path) -> None:
        if self.universal is not None:  # written by another world size (reshard.prepare converted it)
            trainer_state, rank_state = reshard.load(self.engine, path, self.universal, self.rank, self.cfg.seed)
        else:
            trainer_state, rank_state = ckpt.load(self.engine, path, self.rank, self.world_size)
        self.progress = Progress.from_checkpoint(trainer_state)
        if self.engine.global_steps != self.step:
            self.engine.global_steps = self.step
        self.loader.load_state_dict(rank_state["data"])
        ckpt.set_rng_state(rank_state["rng"])
        self.resumed_from = str(path)
        self.last_saved_step = self.step

    # --- training -------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train from ``step`` to ``stop_step``; returns step, skipped steps and the last record.

        One optimizer step = ``train.grad_accum`` micro-batches per rank; DeepSpeed scales the loss by
        1/grad_accum, reduces gradients across ranks, clips, steps AdamW and then the LR schedule.
        A non-finite loss or gradient makes DeepSpeed's ZeRO optimizer see an invalid global gradient
        norm (all-reduced: every rank agrees), skip the update and not advance the schedule
        (``engine.was_step_applied()`` is False). Such steps are counted and logged, and
        ``train.max_nonfinite_in_row`` of them in a row raise ``NonFiniteAbort`` before any further
        checkpoint is written, so the last good checkpoint stays the newest one."""
        cfg, p = self.cfg, self.progress
        self.engine.train()
        data_iter = iter(self.loader)
        window = WindowStats(self.image_token_id)
        window_steps = 0
        exhausted = False
        t_loop = time.perf_counter()
        try:
            while p.step < self.stop_step:
                try:
                    for _ in range(cfg.train.grad_accum):
                        batch = self._next_batch(data_iter)
                        out = self.engine(**self._inputs(batch))
                        out.loss = self.faults.loss(out.loss, p.step + 1, self.rank)
                        window.add(out, batch)
                        self.engine.backward(out.loss)
                        self.engine.step()
                except DataExhausted as err:
                    self.print(f"[train] stopping at step {p.step}: {err}")
                    exhausted = True
                    break
                p.step += 1
                window_steps += 1
                skipped = not self.engine.was_step_applied()  # the last step() was the accumulation boundary
                if skipped:
                    self._count_skipped(window)
                else:
                    p.nonfinite_in_row = 0
                self.logger.advance()
                last = p.step >= self.stop_step
                if p.step % cfg.log.every_steps == 0 or last or skipped:
                    elapsed = time.perf_counter() - t_loop
                    self._log_window(window, elapsed, window_steps)
                    p.train_time_s += elapsed
                    window.reset()
                    window_steps = 0
                    t_loop = time.perf_counter()
                if p.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
                    msg = (f"aborting: {p.nonfinite_in_row} non-finite steps in a row (train.max_nonfinite_in_row="
                           f"{cfg.train.max_nonfinite_in_row}) at step {p.step}; the last good checkpoint is "
                           f"{ckpt.find_checkpoint(cfg.ckpt_dir) or 'none'} (left untouched)")
                    self.print(f"[train] {msg}")
                    raise NonFiniteAbort(msg)
                if cfg.log.visualize_every and p.step % cfg.log.visualize_every == 0:
                    periodic.boundary_picture(self.ctx, p.step, self.logger.tb)
                if cfg.eval.every_steps and p.step % cfg.eval.every_steps == 0 and not last:
                    periodic.periodic_vqa(self.ctx, p.step, self.logger.log)
                if cfg.checkpoint.every_steps and p.step % cfg.checkpoint.every_steps == 0 and not last:
                    self.save_checkpoint()
            if window.micro and not exhausted:
                elapsed = time.perf_counter() - t_loop
                self._log_window(window, elapsed, window_steps)
                p.train_time_s += elapsed
            if cfg.checkpoint.save_final and self.last_saved_step != p.step:
                self.save_checkpoint()
        finally:
            self.logger.close()
        return {"step": p.step, "skipped_steps": p.skipped_steps, "last": p.last_record}

    def _count_skipped(self, window: WindowStats) -> None:
        p = self.progress
        p.skipped_steps += 1
        p.nonfinite_in_row += 1
        # every skipped step is logged, which resets the window: a non-finite loss in it is this step's
        what = "loss" if window.nonfinite > 0 else "gradient"
        self.print(f"[train] step {p.step}: non-finite {what} (grad norm {self.engine.get_global_grad_norm()}), "
                   f"step skipped ({p.nonfinite_in_row} in a row, {p.skipped_steps} total)")

    def _log_window(self, window: WindowStats, elapsed: float, steps: int) -> None:
        p = self.progress
        red = window.reduce()  # collective
        skipped_samples = self._skipped_samples()  # collective
        rec = {"step": p.step, **summarize(red, elapsed, self.world_size)}
        p.tokens_seen += rec["tokens"]
        lrs = self.engine.get_lr()
        rec["lr"] = float(lrs[0]) if lrs else None
        rec["lr_groups"] = {n: float(lr) for n, lr in zip(self.group_names, lrs)}
        gn = self.engine.get_global_grad_norm()
        rec["grad_norm"] = float(gn) if gn is not None else None
        rec["skipped_steps"] = p.skipped_steps
        rec["nonfinite_in_row"] = p.nonfinite_in_row
        rec["skipped_samples"] = skipped_samples
        rec["tokens_seen"] = p.tokens_seen
        fpt = train_flops_per_token(self.text_config, rec["mean_doc_len"], rec.get("ratio"), trains=self.trains)
        if fpt is not None:
            rec["flops_per_token"] = fpt
            rec.update(self.mfu(rec["tokens_per_s"] * fpt, p.step))
        rec["time_s"] = round(time.time() - self.t_start, 3)
        rec.update(process_health())
        p.last_record = rec
        self.logger.log(rec)

    def _skipped_samples(self) -> dict:
        local = dict(getattr(self.loader, "bad_counts", None) or {})  # loaders that drop bad samples count them
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

    # --- after training (vlm/training/callbacks/end_of_run.py) -------------------------------------------------
    def finish(self) -> dict:
        """Export (if asked), eval (if configured), summary table. Collective."""
        return finish.finish(self.ctx, self.progress, self.peak_label, self.t_start)

    def export_hf(self) -> Path:
        return finish.export_hf(self.ctx)

    def close(self) -> None:
        self.logger.close()
