"""What a run leaves for people and tools: summary.json, metrics.jsonl and the trackers, plots/loss.png.
Layer 9, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model."""
