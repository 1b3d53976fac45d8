"""The model and the engine around it: its architecture without weights (architecture: config, vocabulary, counts),
built with its weights (build: ZeRO-3 partitioned, seeded init; hooks: the points where features act on it, the loss
computed inside lm_head: head_loss), LoRA (lora), the optimizer built from its table entry (optimizers; lion: Lion in
torch), and the schedule and deepspeed.initialize (engine).

Layer 7, heavy. May import: the light layers and ds_exp.runtime.
"""
