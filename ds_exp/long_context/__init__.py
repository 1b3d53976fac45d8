"""Long context: model.rope_scaling and the tiling half of DeepSpeed's ALST: tiled MLPs, a tiled loss, activation
offload (model.tiled_mlp(_shards), tiled_loss(_tokens), activation_offload). Each trades speed for activation memory
and leaves the losses as they were. Slices and chunks are counted from the config, never from a batch, so every
rank runs the same number.

settings (light): `LongContextSettings` and `plan` (the counts; the memory planner reads it too). checks (light):
rope_scaling against transformers and the model, the tiling knobs. tiling (`LongContextHooks`): after LoRA and
checkpointing, the MLPs tiled, the offload, the tiled loss unless the fused loss replaced it."""
