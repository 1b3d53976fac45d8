"""The fast path on GPUs (issue 32): the attention kernel (model.attn_implementation), Liger's kernels
(model.liger_kernel), Liger's fused linear cross-entropy (model.fused_loss), compiled decoder layers (train.compile).
Each knob is `auto` (on where it runs and helps: CUDA with the package installed; off on CPUs, so every CPU run is
the plain one), `true` (asked for: a clear message where it cannot run) or `false`.

* settings (light): `FastPathSettings`, a view of the keys, and `decide` (auto decided for an accelerator and a ZeRO
  stage; the dry run and the memory planner read it too). checks (light): what each value needs.
* attention, fused_loss, compile: the kernels. hooks (`FastPathHooks`, on every run) at the model build's points:
  the attention before the weights, Liger's kernels after them, the fused loss (which wins over model.tiled_loss)
  and the compiled layers after LoRA; the `fast path: ...` line and summary.json's fast_path.
"""
