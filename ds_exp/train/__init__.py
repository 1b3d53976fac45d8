"""A training run, top to bottom: the recipe (recipe: setup -> resume -> train -> export), where it starts (resuming:
the checkpoint it continues, or step 0), the session that owns its lifecycle and failures (session), everything
setup builds (workload), batches (collate, sampler), the loop (loop), one optimizer step (step), metric lines
(metrics, flops), evaluation and generation (evaluate, generate), and the lm-eval scores of its exports
(harness).

Layer 10, heavy. May import every layer below it.
"""
