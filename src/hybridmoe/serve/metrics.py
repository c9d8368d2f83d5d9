"""GET /metrics (`serve --metrics`): llama-server's Prometheus metrics, under its names so its dashboards work,
and hybridmoe's batching gauges (sequences, tokens and distinct experts per step)."""
from __future__ import annotations


def prometheus(totals: dict, counts: dict, last_batch: dict, busy: int, waiting: int, kv_tokens: int,
               kv_size: int) -> str:
    """totals: summed over finished requests (prompt_tokens, prompt_seconds, predicted_tokens, predicted_seconds,
    requests); counts: the batcher's per-step sums (decodes, busy_slots, batch_sequences, batch_tokens,
    expert_steps, distinct_experts); last_batch: the last step's model.stats.last_batch."""
    c, n = totals, counts
    steps = n["decodes"]

    def per(x, d):
        return x / d if d else 0.0
    rows = [
        ("llamacpp", "prompt_tokens_total", "counter", "Number of prompt tokens processed.", c["prompt_tokens"]),
        ("llamacpp", "prompt_seconds_total", "counter", "Prompt process time", c["prompt_seconds"]),
        ("llamacpp", "tokens_predicted_total", "counter", "Number of generation tokens processed.",
         c["predicted_tokens"]),
        ("llamacpp", "tokens_predicted_seconds_total", "counter", "Predict process time", c["predicted_seconds"]),
        ("llamacpp", "n_decode_total", "counter", "Total number of llama_decode() calls (batched steps).", steps),
        ("llamacpp", "n_busy_slots_per_decode", "counter", "Average number of busy slots per llama_decode() call",
         per(n["busy_slots"], steps)),
        ("llamacpp", "requests_total", "counter", "Generations finished.", c["requests"]),
        ("llamacpp", "prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         per(c["prompt_tokens"], c["prompt_seconds"])),
        ("llamacpp", "predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         per(c["predicted_tokens"], c["predicted_seconds"])),
        ("llamacpp", "kv_cache_tokens", "gauge", "KV-cache tokens.", kv_tokens),
        ("llamacpp", "kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         per(kv_tokens, kv_size)),
        ("llamacpp", "requests_processing", "gauge", "Number of requests processing.", busy),
        ("llamacpp", "requests_deferred", "gauge", "Number of requests deferred.", waiting),
        ("hybridmoe", "batch_sequences_total", "counter", "Sequences summed over the steps.", n["batch_sequences"]),
        ("hybridmoe", "batch_tokens_total", "counter", "Tokens summed over the steps.", n["batch_tokens"]),
        ("hybridmoe", "expert_steps_total", "counter", "Batched steps that reported their distinct experts.",
         n["expert_steps"]),
        ("hybridmoe", "distinct_experts_total", "counter", "Distinct experts summed over those steps.",
         n["distinct_experts"]),
        ("hybridmoe", "batch_sequences_per_decode", "gauge", "Average sequences in one step.",
         per(n["batch_sequences"], steps)),
        ("hybridmoe", "batch_tokens_per_decode", "gauge", "Average tokens in one step (prompt chunks included).",
         per(n["batch_tokens"], steps)),
        ("hybridmoe", "batch_sequences", "gauge", "Sequences in the last step.", last_batch.get("sequences", 0)),
        ("hybridmoe", "batch_tokens", "gauge", "Tokens in the last step.", last_batch.get("tokens", 0)),
        ("hybridmoe", "distinct_experts_per_decode", "gauge",
         "Average distinct experts a batched step activated (model.stats.last_batch; 0 before the first).",
         per(n["distinct_experts"], n["expert_steps"])),
        ("hybridmoe", "distinct_experts", "gauge", "Distinct experts the last batched step activated.",
         last_batch.get("distinct_experts", 0)),
    ]
    out = []
    for ns, name, kind, help_, v in rows:
        out += [f"# HELP {ns}:{name} {help_}", f"# TYPE {ns}:{name} {kind}", f"{ns}:{name} {v}"]
    return "\n".join(out) + "\n"
