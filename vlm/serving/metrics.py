"""``/metrics``: the engine's counters and gauges as Prometheus text (exposition format 0.0.4)."""
from __future__ import annotations


def prometheus_text(engine, http_errors: dict[int, int]) -> str:
    s = engine.stats
    rows = [
        ("vlm_requests_total", "counter", "requests accepted into the queue", s["requests"]),
        ("vlm_requests_finished_total", "counter", "requests answered to the end", s["finished"]),
        ("vlm_requests_cancelled_total", "counter", "requests cancelled (client gone)", s["cancelled"]),
        ("vlm_requests_timed_out_total", "counter", "requests past their timeout", s["timed_out"]),
        ("vlm_requests_rejected_queue_full_total", "counter", "requests refused with 429", s["rejected_queue_full"]),
        ("vlm_queue_length", "gauge", "requests waiting for admission", len(engine.waiting)),
        ("vlm_active_rows", "gauge", "requests decoding in the batch", len(engine.active)),
        ("vlm_generated_tokens_total", "counter", "tokens sampled", s["tokens"]),
        ("vlm_tokens_per_second", "gauge", "tokens sampled per second over the last 10 s", engine.tokens_per_s()),
        ("vlm_kv_bytes_held", "gauge", "bytes of the active rows' token and concept caches", engine.held_bytes()),
        ("vlm_kv_bytes_allocated", "gauge", "bytes of the slot table's pool (all slots)", engine.allocated_bytes()),
        ("vlm_kv_budget_bytes", "gauge", "the KV budget admission counts against", engine.kv_budget),
        ("vlm_kv_bytes_per_request", "gauge", "bytes one request's caches are allocated at", engine.request_bytes),
        ("vlm_achieved_ratio", "gauge", "tokens per concept-cache entry over the served and active requests (0: none)",
         engine.achieved_ratio()),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value if isinstance(value, int) else format(value, '.6g')}"]
    out += ["# HELP vlm_http_errors_total responses with an error status", "# TYPE vlm_http_errors_total counter"]
    out += [f'vlm_http_errors_total{{status="{code}"}} {n}' for code, n in sorted(http_errors.items())]
    return "\n".join(out) + "\n"
