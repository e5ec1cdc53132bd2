"""The end-of-run summary table (vlm/training/callbacks/end_of_run.py): every row inside its borders, the
MFU beside the peak it divides by, and that peak's source on its own row."""
from __future__ import annotations

from vlm.training.callbacks.end_of_run import summary_table
from vlm.training.state import Progress

LABEL = ("3.64e+10 FLOP/s/device (cached (measured 2026-12-06 02:50:01): fastest 1024x1024 float32 matmul on "
         "1 CPU thread(s); from /home/someone/.cache/conceptmoe-vl/cpu_peak.json; VLM_REMEASURE_PEAK=1 "
         "measures again)")


def test_no_row_overflows_and_the_mfu_names_its_peak():
    progress = Progress(step=300, tokens_seen=1000, train_time_s=10.0,
                        last_record={"loss": 0.7, "lm_loss": 0.6, "mfu": 0.1096})
    eval_result = {"accuracy": 0.61, "correct": 183, "total": 300, "breakdown_by": "kind",
                   "by_kind": {"a-kind-whose-name-is-long-enough-to-widen-the-first-column": 0.5}}
    table = summary_table("a-run", progress, LABEL, 12.0, eval_result)
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1, table  # one width: nothing runs past the border
    assert all(line[0] in "+|" and line[-1] in "+|" for line in lines), table
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("|")]
    assert ["MFU (last window)", "10.96% of 3.64e+10 FLOP/s/device"] in rows, table
    peak = rows.index(["MFU (last window)", "10.96% of 3.64e+10 FLOP/s/device"]) + 1
    assert rows[peak][0] == "peak" and rows[peak][1].startswith("cached (measured 2026-12-06 02:50:01)"), table
    source = " ".join(r[1] for r in rows[peak:peak + 3] if r[0] in ("peak", ""))
    assert "1 CPU thread(s)" in source, table
