"""The training loop: a DeepSpeed engine (ZeRO-1/2/3) over the model, the data loader, atomic
checkpoints and exact resume. ``fit`` repeats ``train_step`` and calls the callbacks (protocol:
``callbacks/base.py``; the default list and its order: ``callbacks/defaults.py``): the logging window,
the in-training evals, the checkpoint interval and, in ``finish``, the export / eval."""
from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vlm.config.train import TrainConfig
from vlm.modeling.fused_kernels import resolve as resolve_fused_kernels
from vlm.modeling.moe import EXPERT_LAYOUT
from vlm.training import checkpoint as ckpt
from vlm.training import optim, reshard
from vlm.training.callbacks.base import Callback, StepEnd
from vlm.training.callbacks.defaults import default_callbacks
from vlm.training.callbacks.end_of_run import export_hf
from vlm.training.callbacks.nonfinite_guard import NonFiniteAbort
from vlm.training.data import build_loader, check_data_paths
from vlm.training.distributed import (
    barrier,
    build_ds_config,
    init_distributed,
    resolve_device,
)
from vlm.flops.training import Trains
from vlm.training.build import build_processor, setup_model, text_config_of
from vlm.training.metrics import MetricsLogger, MfuMeter
from vlm.training.ds_compat import fallback_line as ds_fallback_line
from vlm.training.overflow import use_norm_overflow_check
from vlm.training.one_rank import skip_single_rank_reduction
from vlm.training.zero_norm import use_one_norm_read
from vlm.training.peak import resolve_peak
from vlm.training.prepare import prepare_model
from vlm.training.state import Progress, RunContext
from vlm.training.zero3 import register_zero3_external

__all__ = ["DataExhausted", "NonFiniteAbort", "Trainer", "seed_everything"]


class DataExhausted(RuntimeError):
    pass


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


class Trainer:
    """Build everything for ``cfg`` (collective), resume from ``resume`` (``auto`` or a path), then
    ``fit()`` and ``finish()``. ``callbacks``: the hooks ``fit`` and ``finish`` call, in this order
    (default ``default_callbacks()``). ``save_hook``: called at the checkpoint writer's named points
    (``checkpoint.SaveHook``, a no-op; the reliability suite sets its fault plan there)."""

    def __init__(self, cfg: TrainConfig, resume: str | None = None, callbacks: Sequence[Callback] | None = None):
        self.cfg = cfg
        check_data_paths(cfg)  # a missing file is one line before the model is built
        self.logger: MetricsLogger | None = None
        self.callbacks = list(default_callbacks() if callbacks is None else callbacks)
        self.save_hook: ckpt.SaveHook = ckpt.NO_HOOK
        self.t_start = time.time()
        self.device = resolve_device(cfg.device)
        # a fused kernel named where it cannot run (device, package): one line before anything is built;
        # what depends on the model and the ZeRO stage is decided in prepare_model
        resolve_fused_kernels(cfg.train.fused_kernels.model_dump(), self.device)
        info = init_distributed(self.device, timeout_s=cfg.dist_timeout_s, cpu_threads=cfg.cpu_threads)
        self.rank, self.world_size, self.local_rank = info["rank"], info["world_size"], info["local_rank"]
        self.is_main = self.rank == 0
        if info["warning"]:  # more CPU ranks than cores (rank 0 says it)
            self.log_line(info["warning"])
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device == "cuda")
        if self.bf16 and self.device == "cpu":
            self.log_line("[train] precision bf16 asked for on CPU: using it (slow); precision: auto gives fp32")
        self.run_dir = cfg.run_dir
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "train_config.json", "w", encoding="utf-8") as f:
                json.dump(cfg.to_dict(), f, indent=1)
        self.ds_config = build_ds_config(cfg, self.world_size, self.bf16)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        self.resume_path = ckpt.resolve_resume(resume, cfg.ckpt_dir)
        if self.resume_path is not None:  # said first: the init lines below are not the weights trained on
            self.log_line(f"[train] resuming from {self.resume_path}: the model is built with the initial "
                          "weights logged below, then every weight is replaced by the checkpoint's")
        # model (identical on every rank: same seed), then per-rank randomness
        seed_everything(cfg.seed)
        setup = setup_model(cfg, self.log_line)
        self.tokenizer, self.model_config, model = setup.tokenizer, setup.model_config, setup.model
        self.text_config = text_config_of(self.model_config)
        self.image_token_id = getattr(self.model_config, "image_token_id", None)
        self.processor = build_processor(model, self.tokenizer)
        counts = prepare_model(model, cfg, zero_stage=self.zero_stage, world_size=self.world_size,
                               dtype=torch.bfloat16 if self.bf16 else torch.float32, log_line=self.log_line,
                               device=self.device)
        self.total_counts, self.trainable_counts = counts.total, counts.trainable
        self.ep_size = cfg.parallel.expert_parallel_size
        seed_everything(cfg.seed * 1000 + 1 + self.rank)
        import deepspeed

        # another world size: the checkpoint is converted once to DeepSpeed's universal format here (reshard.py)
        ckpt.check_expert_layout(self.resume_path, model)
        self.universal = reshard.prepare(self.resume_path, self.world_size, self.zero_stage, self.ds_config,
                                         self.rank, self.log_line, cfg.parallel.expert_parallel_size)
        if self.zero_stage == 0:
            self.log_line("[train] warning: ZeRO stage 0 in fp32 does not skip non-finite steps; use zero1/2/3")
        optimizer = optim.build_optimizer(model, cfg)
        self.group_names = [g["name"] for g in optimizer.param_groups]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=optim.scheduler_factory(cfg), config=self.ds_config)
        if self.zero_stage == 3:
            register_zero3_external(self.engine.module)
        self.norm_overflow_check = use_norm_overflow_check(self.engine.optimizer)
        self.one_norm_read = use_one_norm_read(self.engine.optimizer)
        self.single_rank_reduction_skipped = skip_single_rank_reduction(self.engine.optimizer)
        if (line := ds_fallback_line(self.engine.optimizer)) is not None:
            self.log_line(line)  # a patch left out: this DeepSpeed differs from the tested one (ds_compat.py)
        self.ctx = RunContext(cfg=cfg, run_dir=self.run_dir, is_main=self.is_main, zero_stage=self.zero_stage,
                              device=self.device, model_device=self.engine.device, module=self.engine.module,
                              model_config=self.model_config, processor=self.processor, tokenizer=self.tokenizer,
                              log_line=self.log_line)
        self.loader = build_loader(cfg, self.engine.module, self.model_config, self.tokenizer, self.processor,
                                   self.rank, self.world_size)
        if self.is_main and hasattr(self.loader, "report"):  # the first bad records of each reason, one line each
            self.loader.report = self.log_line
        self.progress = Progress()
        self.resumed_from: str | None = None
        self.last_saved_step: int | None = None
        path = self.resume_path
        if resume == "auto" and path is None:
            self.log_line(f"[train] --resume auto: no complete checkpoint in {cfg.ckpt_dir}, starting fresh")
        if path is not None:
            self._load(path)
        elif self.is_main:
            self._set_aside_previous_run()
        barrier()
        # (step, train time) this process started from: the summary tells its own time from the earlier runs'
        self.resumed_at = (self.step, self.progress.train_time_s) if path is not None else None
        self.stop_step = cfg.train.stop_at_step or cfg.train.max_steps
        self.peak_flops, peak_source = resolve_peak(cfg.log.peak_flops, self.device,
                                                    torch.bfloat16 if self.bf16 else torch.float32)
        self.peak_label = f"{self.peak_flops:.3g} FLOP/s/device ({peak_source})"
        self.mfu = MfuMeter(self.peak_flops, self.world_size, self.peak_label, self.log_line)
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
    def log_line(self, text: str) -> None:
        """One line for the console and the log (rank 0; the progress bar stays intact)."""
        if self.is_main:
            if self.logger is not None:
                self.logger.write(text)
            else:
                print(text, flush=True)

    def _set_aside_previous_run(self) -> None:
        """A fresh start in a run folder that already holds checkpoints / metrics / an export (e.g.
        `make train-vlm` twice): move them to ckpt.previous / metrics.previous.jsonl (one generation is
        kept) so that ``--resume auto`` can never pick up a stale checkpoint of the earlier run. The
        earlier export stays loadable at <run>/hf until this run's replaces it (``export_hf``: it is then
        hf.previous); a run that exports nothing moves it to hf.previous now, not to be taken for its own."""
        import shutil

        ck = Path(self.cfg.ckpt_dir)
        if ck.is_dir() and (ckpt.list_checkpoints(ck) or any(ck.glob("step_*"))):
            prev = ck.with_name(ck.name + ".previous")
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(ck, prev)
            self.log_line(f"[train] fresh start: moved the earlier checkpoints to {prev} "
                          "(use --resume auto to continue)")
        hf = self.run_dir / "hf"
        if hf.is_dir() and not self.cfg.checkpoint.export_hf:  # else kept until this run's export replaces it
            prev = hf.with_name("hf.previous")
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(hf, prev)
            self.log_line(f"[train] fresh start: moved the earlier run's Hugging Face export to {prev}")
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
            self.log_line(line)

    def _inputs(self, batch: dict) -> dict:
        """The model's inputs on its device: on CUDA each tensor is copied into pinned host memory, then to
        the device with ``non_blocking`` (a copy from pageable memory would wait for the queued kernels)."""
        dev = torch.device(self.ctx.model_device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if dev.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(dev, non_blocking=True)
            return t.to(dev)
        inputs = {k: move(batch[k]) for k in ("input_ids", "attention_mask", "position_ids", "labels",
                                              "segment_ids") if batch.get(k) is not None}
        if batch.get("doc_layout") is not None:  # built by the collator on the host (moved in the model)
            inputs["doc_layout"] = batch["doc_layout"]
        if self.cfg.model.kind == "vlm":
            pix = batch.get("pixel_values")
            if pix is not None:
                pix = move(pix).to(dtype=torch.bfloat16 if self.bf16 else torch.float32)
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
                "expert_layout": EXPERT_LAYOUT,
                "config": self.cfg.to_dict(), "last_metrics": self.progress.last_metrics()}

    def save_checkpoint(self) -> Path:
        rank_state = {"rng": ckpt.rng_state(), "data": self.loader.state_dict()}
        path = ckpt.save(self.engine, self.cfg.ckpt_dir, self.step, self._trainer_state(), rank_state,
                         keep_last=self.cfg.checkpoint.keep_last, rank=self.rank, world_size=self.world_size,
                         hook=self.save_hook)
        self.last_saved_step = self.step
        self.log_line(f"[train] checkpoint step {self.step} -> {path}")
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
        """Train from ``step`` to ``stop_step`` (every callback's ``on_step_start``, ``train_step``, then every
        callback's ``on_step_end``);
        returns step, skipped steps and the last record. Data running out ends the loop early."""
        self.engine.train()
        data_iter = iter(self.loader)
        exhausted = False
        try:
            self._call("on_fit_start")
            while self.step < self.stop_step:
                self._call("on_step_start")
                try:
                    step = self.train_step(data_iter)
                except DataExhausted as err:
                    self.log_line(f"[train] stopping at step {self.step}: {err}")
                    exhausted = True
                    break
                self._call("on_step_end", step)
            self._call("on_fit_end", exhausted)
        finally:
            self.logger.close()
        p = self.progress
        return {"step": p.step, "skipped_steps": p.skipped_steps, "last": p.last_record}

    def train_step(self, data_iter) -> StepEnd:
        """One optimizer step: ``train.grad_accum`` micro-batches per rank; DeepSpeed scales the loss by
        1/grad_accum, reduces gradients across ranks, clips, steps AdamW and then the LR schedule.

        A non-finite loss or gradient makes DeepSpeed's ZeRO optimizer see an invalid global gradient
        norm (all-reduced: every rank agrees), skip the update and not advance the schedule
        (``engine.was_step_applied()`` is False). Such steps are counted and logged (the callback
        ``NonFiniteGuard`` aborts after ``train.max_nonfinite_in_row`` of them in a row)."""
        p = self.progress
        nonfinite_loss = None  # micro-batches with a non-finite loss, on the device (read if skipped)
        for _ in range(self.cfg.train.grad_accum):
            batch = self._next_batch(data_iter)
            inputs = self._inputs(batch)
            batch = {**batch, "device": inputs}  # callbacks read the moved tensors there (no second copy)
            out = self.engine(**inputs)
            self._call("on_micro_batch", out, batch)
            bad = (~torch.isfinite(out.loss.detach())).sum()
            nonfinite_loss = bad if nonfinite_loss is None else nonfinite_loss + bad
            self.engine.backward(out.loss)
            self.engine.step()
        p.step += 1
        skipped = not self.engine.was_step_applied()  # the last step() was the accumulation boundary
        if skipped:
            self._count_skipped("loss" if int(nonfinite_loss) > 0 else "gradient")
        else:
            p.nonfinite_in_row = 0
        self.logger.advance()
        return StepEnd(step=p.step, skipped=skipped, last=p.step >= self.stop_step)

    def _count_skipped(self, what: str) -> None:
        p = self.progress
        p.skipped_steps += 1
        p.nonfinite_in_row += 1
        self.log_line(f"[train] step {p.step}: non-finite {what} (grad norm {self.engine.get_global_grad_norm()}), "
                      f"step skipped ({p.nonfinite_in_row} in a row, {p.skipped_steps} total)")

    def _call(self, hook: str, *args) -> list:
        return [getattr(cb, hook)(self, *args) for cb in self.callbacks]

    # --- after training (callbacks/end_of_run.py) -------------------------------------------------
    def finish(self) -> dict:
        """Collective: every callback's ``on_train_end`` (export if asked, eval if configured, summary
        table); their results merged."""
        out: dict = {}
        for res in self._call("on_train_end"):
            out.update(res or {})
        return out

    def export_hf(self) -> Path:
        return export_hf(self.ctx)

    def close(self) -> None:
        self.logger.close()
        for cb in self.callbacks:
            cb.close()
