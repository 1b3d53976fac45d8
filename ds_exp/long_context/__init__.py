"""Long context: model.rope_scaling (a rotary model's context stretched) and the tiling half of DeepSpeed's ALST:
tiled MLPs, a tiled loss, activation offload (model.tiled_mlp(_shards), tiled_loss(_tokens), activation_offload).
Each trades speed for activation memory and leaves the losses as they were (tests/integration/test_tiling.py).
Slices and chunks are counted from the config (data.max_seq_len per sequence-parallel rank, the micro batch sizes),
never from a batch, so every rank runs the same number.

* settings (light): `LongContextSettings`, a view of the keys, and `plan` (the slice and chunk counts, which the
  memory planner reads too).
* checks (light): model.rope_scaling against transformers' fields and the model's position encoding (merged into the
  model's config by ds_exp/model/architecture.py), the tiling knobs against each other and the model's logits.
* tiling (`LongContextHooks`, on when a tiling knob is): after LoRA and checkpointing (ds_exp/model/hooks.py), the
  MLPs tiled, the offload around the decoder, the tiled loss unless the fused loss (ds_exp/fast_path/) replaced it.
"""
