"""What a run leaves for people and tools: summary.json (summary), metrics.jsonl and the trackers (tracking,
trackers/), the picture plots/loss.png (loss_plot).


Layer 9, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model.
"""
