"""The model and its engine: architecture without weights, the build (seeded init, the features' hooks, head_loss),
LoRA, the optimizer (optimizers, lion), the schedule and deepspeed.initialize (engine). Layer 7, heavy. May import:
the light layers and ds_exp.runtime."""
