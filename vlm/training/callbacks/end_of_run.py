"""After training (``EndOfRun``, run by ``Trainer.finish``): the Hugging Face export (gathered under
ZeRO-3 / expert parallelism), the held-out VQA evaluation of the exported (or trained) model, and the
summary table / summary.json."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from vlm.training.callbacks.base import Callback
from vlm.training.distributed import barrier
from vlm.training.gathered import gather_state, scoring_model, unsharded_model
from vlm.training.state import Progress, RunContext

VALUE_WIDTH = 48  # the summary table's value column wraps beyond this


def export_hf(ctx: RunContext) -> Path:
    """Collective: gather full weights (ZeRO-3 / expert parallel) and write <run>/hf on rank 0 (LoRA
    adapters merged). Written to <run>/hf.partial first and swapped in once complete, so an earlier
    export stays loadable at <run>/hf until then (an interrupted or failed export leaves it as it was)."""
    import shutil

    out_dir = ctx.run_dir / "hf"
    state = gather_state(ctx)
    if ctx.is_main:
        partial = out_dir.with_name("hf.partial")
        shutil.rmtree(partial, ignore_errors=True)  # a partial folder of an earlier interrupted export
        fresh = unsharded_model(ctx, state)
        fresh.save_pretrained(str(partial))
        if ctx.processor is not None:
            ctx.processor.save_pretrained(str(partial))
        elif ctx.tokenizer is not None:
            ctx.tokenizer.save_pretrained(str(partial))
        earlier = swap_in(partial, out_dir)
        ctx.log_line(f"[train] exported Hugging Face model to {out_dir}"
                     + (f" (the earlier export is now {earlier})" if earlier else ""))
    barrier()
    return out_dir


def swap_in(new: Path, dst: Path) -> Path | None:
    """Put the complete folder ``new`` at ``dst``; an existing ``dst`` becomes ``dst.previous`` (one
    generation kept), returned. Two renames: between them ``dst.previous`` and ``dst``'s new folder
    are both complete; ``dst`` is never a half-written folder."""
    import shutil

    earlier = None
    if dst.exists():
        earlier = dst.with_name(dst.name + ".previous")
        shutil.rmtree(earlier, ignore_errors=True)
        dst.rename(earlier)
    new.rename(dst)
    return earlier


def _eval_model(ctx: RunContext, hf_dir: Path | None):
    """Collective: the model the end-of-run eval scores, on rank 0 (None on the others): the export
    if there is one, else ``scoring_model`` (the live module, or under ZeRO-3 / expert parallelism an
    unsharded copy of the gathered weights: rank 0 alone cannot run its shard)."""
    if hf_dir is not None and (hf_dir / "config.json").is_file():
        if not ctx.is_main:
            return None
        from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration

        return ConceptMoEVLMForConditionalGeneration.from_pretrained(str(hf_dir))
    model = scoring_model(ctx)
    if model is not None and model is not ctx.module:
        why = "ZeRO-3" if ctx.zero_stage == 3 else "expert parallelism"
        ctx.log_line(f"[train] eval: on an unsharded copy of the gathered weights ({why}, no export)")
    return model


def evaluate(ctx: RunContext, hf_dir: Path | None) -> dict | None:
    """Collective: held-out digits VQA, scored on rank 0, on the exported model (loaded back with
    from_pretrained) or without an export on the trained weights (``_eval_model``)."""
    e = ctx.cfg.eval
    result = None
    if e.vqa_json and ctx.cfg.model.kind == "vlm" and ctx.processor is not None:  # the same on every rank
        from eval_suites.digits_vqa import digits_vqa_accuracy

        model = _eval_model(ctx, hf_dir)
        if model is not None:
            model = model.to(ctx.model_device).float() if ctx.device == "cpu" else model.to(ctx.model_device)
            t0 = time.perf_counter()
            result = digits_vqa_accuracy(model, ctx.processor, e.vqa_json, e.image_root or "", e.limit,
                                         batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                                         breakdown_by=e.breakdown_by)
            result["eval_time_s"] = time.perf_counter() - t0
    barrier()
    return result


def summary_table(name: str, progress: Progress, peak_label: str, wall_s: float,
                  eval_result: dict | None, resumed_at: tuple[int, float] | None = None) -> str:
    """The end-of-run table. ``peak_label``: the MFU's peak and its source (``Trainer.peak_label``);
    ``wall_s``: this process's; ``resumed_at``: (step, train time) this process resumed from, if it did."""
    rec = progress.last_record
    bad = {k: int(v) for k, v in (rec.get("skipped_samples") or {}).items() if v}  # loader, all ranks
    rows = [("optimizer steps", f"{progress.step} ({progress.skipped_steps} skipped: non-finite)"),
            ("skipped samples (bad data)", f"{sum(bad.values())}")]
    rows += [(f"  {reason}", f"{n}") for reason, n in sorted(bad.items(), key=lambda kv: (-kv[1], kv[0]))]
    rows.append(("final train loss (lm)",
                 f"{rec.get('loss', float('nan')):.4f} ({rec.get('lm_loss', float('nan')):.4f})"))
    if eval_result:
        acc = f"{eval_result['accuracy']:.1%} ({eval_result['correct']}/{eval_result['total']})"
        rows.append(("held-out VQA accuracy", acc))
        field = eval_result.get("breakdown_by")
        for kind, acc in eval_result.get("by_kind", {}).items():
            rows.append((f"  {field}={kind}" if field and field != "kind" else f"  {kind}", f"{acc:.1%}"))
        if eval_result.get("breakdown_missing"):
            rows.append((f"  by {field}", "none: no record has this field"))
        for key in ("ratio", "ratio_image", "ratio_text"):
            if key in eval_result:
                rows.append((f"eval achieved R ({key.replace('ratio_', '') if '_' in key else 'pooled'})",
                             f"{eval_result[key]:.2f}"))
    for key in ("ratio", "ratio_image", "ratio_text"):
        if key in rec:
            rows.append((f"train achieved R ({key.replace('ratio_', '') if '_' in key else 'pooled'})",
                         f"{rec[key]:.2f}"))
    tps = progress.tokens_seen / progress.train_time_s if progress.train_time_s else float("nan")
    rows.append(("train tokens/s (mean)", f"{tps:,.0f}"))
    if "mfu" in rec:  # the peak's value beside the MFU, its source on the next row
        peak, _, source = str(peak_label).partition(" (")
        rows.append(("MFU (last window)", f"{rec['mfu']:.2%} of {peak}"))
        if source:
            rows.append(("  peak", source.removesuffix(")").split("; ")[0]))
    rows += time_rows(progress, wall_s, resumed_at)
    return format_table(f"summary: {name}", rows)


def format_table(title: str, rows: list[tuple[str, str]], max_value: int = VALUE_WIDTH) -> str:
    """A two-column text table; values longer than ``max_value`` wrap onto continuation lines, so that no
    row runs past the border."""
    import textwrap

    lines = [(k, part) for k, v in rows
             for i, part in enumerate(textwrap.wrap(v, max_value, break_on_hyphens=False) or [""])
             for k in [k if i == 0 else ""]]
    width = max(len(title), *(len(k) for k, _ in lines))
    vwidth = max(32, *(len(v) for _, v in lines))
    border = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    body = [border, f"| {title:<{width}} | {'':<{vwidth}} |", border]
    body += [f"| {k:<{width}} | {v:<{vwidth}} |" for k, v in lines]
    body.append(border)
    return "\n".join(body)


def time_rows(progress: Progress, wall_s: float, resumed_at: tuple[int, float] | None) -> list[tuple[str, str]]:
    """Training time of this process beside its wall time (which holds it); after a resume, also the
    time of all steps, the earlier runs' included (what the mean tokens/s divides by)."""
    if resumed_at is None:
        return [(f"train time (steps 1-{progress.step})", f"{progress.train_time_s:.1f} s"),
                ("wall time (startup, train, export, eval)", f"{wall_s:.1f} s")]
    step0, time0 = resumed_at
    return [(f"train time, this process (steps {step0 + 1}-{progress.step})",
             f"{progress.train_time_s - time0:.1f} s"),
            (f"train time, steps 1-{progress.step} (incl. before the resume)", f"{progress.train_time_s:.1f} s"),
            ("wall time, this process (startup, train, export, eval)", f"{wall_s:.1f} s")]


def machine() -> dict:
    """Where the run ran, for the figures quoted from summary.json (scripts/readme_figures.py)."""
    import os

    from vlm.training.peak import cpu_model

    return {"cpu": cpu_model(), "cpu_count": os.cpu_count()}


def finish(ctx: RunContext, progress: Progress, peak_label: str, t_start: float,
           resumed_at: tuple[int, float] | None = None) -> dict:
    """Collective: export (if asked), eval (if configured), summary table and <run>/summary.json.
    ``t_start``: this process's start (``time.time()``), for the wall time; ``resumed_at``: see
    ``summary_table``."""
    hf_dir = export_hf(ctx) if ctx.cfg.checkpoint.export_hf else None
    result = evaluate(ctx, hf_dir)
    table = summary_table(ctx.cfg.name, progress, peak_label, time.time() - t_start, result, resumed_at)
    if ctx.is_main:
        print(table, flush=True)
        with open(ctx.run_dir / "summary.json", "w", encoding="utf-8") as f:
            json.dump({"step": progress.step, "skipped_steps": progress.skipped_steps,
                       "skipped_samples": dict(progress.last_record.get("skipped_samples") or {}), "eval": result,
                       "train_time_s": progress.train_time_s, "wall_time_s": time.time() - t_start,
                       "resumed_at_step": resumed_at[0] if resumed_at else None,
                       "train_time_this_process_s": progress.train_time_s - (resumed_at[1] if resumed_at else 0.0),
                       "tokens_seen": progress.tokens_seen, "last_metrics": progress.last_metrics(),
                       "mfu_peak": peak_label, "machine": machine()},
                      f, indent=1, default=lambda o: str(o) if isinstance(o, float) and not math.isfinite(o) else o)
    return {"eval": result, "summary": table}


class EndOfRun(Callback):
    def on_train_end(self, trainer) -> dict:
        return finish(trainer.ctx, trainer.progress, trainer.peak_label, trainer.t_start, trainer.resumed_at)
