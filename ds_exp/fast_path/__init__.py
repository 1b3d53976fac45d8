"""The fast path on GPUs (issue 32): the attention kernel (model.attn_implementation), Liger's kernels
(model.liger_kernel), Liger's fused linear cross-entropy (model.fused_loss) and compiled decoder layers
(train.compile). Each knob is `auto` (on where it runs and helps: a CUDA GPU with the package installed; off on CPUs,
so every CPU run is the plain one), `true` (asked for: a clear message where it cannot run) or `false`; the attention
takes a name (auto: flash-attn, else torch's varlen kernel, else sdpa, on CUDA in 16 bits).

* settings (light): `FastPathSettings`, a view of the keys where users type them (model.attn_implementation,
  model.liger_kernel, model.fused_loss, train.compile), and `decide`: each knob with auto decided for an accelerator
  and a ZeRO stage; the dry run (plan.json's fast_path) and the memory planner read it too.
* checks (light): attention names transformers has, FlashAttention's package and GPU, flex attention's backward on
  CPUs, and each knob's value and what asking for it needs.
* attention: `auto` decided, torch's varlen kernel registered with transformers (`torch_varlen`), and packed rows'
  example boundaries for a varlen kernel.
* fused_loss: the loss through Liger's kernel inside lm_head's call (ds_exp/model/head_loss.py).
* compile: torch.compile of each decoder layer (regional compilation).
* hooks (`FastPathHooks`, on every run: the attention is chosen on every run), at the model build's points
  (ds_exp/model/hooks.py): before the weights the attention, after the weights Liger's kernels (before the
  vocabulary is padded and LoRA wraps the model), after LoRA and checkpointing the fused loss (which wins over
  model.tiled_loss) and the compiled layers; it logs the `fast path: ...` line and records summary.json's fast_path.
"""
