"""Long context: model.rope_scaling (a rotary model's context stretched), and the tiling half of DeepSpeed's ALST
recipe: tiled MLPs, a tiled loss, activation offload (model.tiled_mlp(_shards), tiled_loss(_tokens),
activation_offload).

Each knob trades speed for activation memory and leaves the math as it was: a run with any of them on has the
losses of the run without (tests/integration/test_tiling.py; fp32, 1e-5 relative).

* `model.tiled_mlp`: every decoder layer's MLP runs over `shards` slices of the sequence, each slice under its own
  (non-reentrant) activation checkpoint, so the MLP's intermediate activations (several tokens x intermediate
  tensors) exist for one slice at a time, in the forward and in the backward, which recomputes each slice. This is
  DeepSpeed's TiledMLP (ALST) computed with torch.utils.checkpoint, for two reasons. (1) ZeRO-3 gathers the MLP's
  weights for every slice, so every rank must run the same number of slices or the gathers hang: ds_exp fixes the
  number from the config (never from the batch) and always cuts exactly that many (`torch.tensor_split`; slices may
  be empty), while DeepSpeed's TiledMLP cuts with `torch.chunk`, which returns fewer pieces than asked for some
  lengths (9 tokens in 4 -> 3), so ranks holding rows of different lengths would disagree even with an agreed
  count. (2) A checkpoint per slice keeps one backward pass: every weight's gradient is accumulated once, so
  ZeRO's gradient hooks need no `ds_grad_is_ready` bookkeeping (a DeepSpeed-internal attribute).
  Position-wise MLPs only (every token computed on its own): the MLP module of each decoder layer.
* `model.tiled_loss`: the final hidden states go through the output embeddings (lm_head) and the cross-entropy in
  chunks of tokens, each chunk checkpointed: one chunk's logits exist at a time, forward and backward. It returns
  the per-rank sum of token losses and the label count, exactly what `ds_exp.train.step.token_loss_sum` computes from
  full logits, so the step's exact reduction over the global batch is unchanged. It runs inside lm_head's own call
  (that call's forward is replaced while a tiled loss is asked for), so under ZeRO-3 lm_head is gathered once per
  forward as usual. DeepSpeed's TiledFusedLogitsLoss does not fit: it accumulates lm_head's gradient during the
  forward with an incoming gradient of 1, and scales only the hidden states' gradient by the real one in backward,
  while ds_exp's step scales the loss by world x micro batches / global label tokens.
* `model.activation_offload`: with gradient checkpointing, what each checkpointed layer keeps for its recompute
  (its input) is saved through `torch.autograd.graph.save_on_cpu` around the decoder's forward: in pinned host
  memory, copied back when the backward recomputes the layer (ALST's checkpoint offload; transformers 5 has the
  same as `activation_checkpointing_enable(offload=True)`, which pins memory unconditionally and so fails on a
  host without CUDA). On a CPU the activations already live in host memory: nothing moves.

Slices and chunks are counted from `data.max_seq_len` (per sequence-parallel rank) and the micro batch sizes, fixed
before training, so every rank runs the same number whatever its batch holds.

* settings (light): `LongContextSettings`, a view of the model.* keys and what the plan and the checks read (the
  sequence length per rank, the micro batch sizes, the model's config); `plan`: how many MLP slices and loss chunks a
  run cuts, from the config alone, which the memory planner reads too.
* checks (light): model.rope_scaling against transformers' fields and the model's position encoding (it is merged
  into the model's config by ds_exp/model/architecture.py), and the tiling knobs against each other and the model's
  logits.
* tiling (`LongContextHooks`, on when a tiling knob is): after LoRA and checkpointing (ds_exp/model/hooks.py), the
  MLPs tiled, the offload around the decoder, and the tiled loss unless the fused loss (ds_exp/fast_path/) replaced
  it; the `long context: ...` log line.
"""
