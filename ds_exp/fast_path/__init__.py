"""The fast path on GPUs: the attention kernel (model.attn_implementation), Liger's kernels (model.liger_kernel), the
fused linear cross-entropy (model.fused_loss), compiled decoder layers (train.compile). Each knob is `auto` (on where
it runs and helps; off on CPUs), `true` (a clear message where it cannot run) or `false`.

settings (light): `FastPathSettings` and `decide` (auto decided; the dry run and memory planner read it). checks
(light). attention, fused_loss, compile: the kernels. hooks (`FastPathHooks`, every run) at the model build's points;
the `fast path: ...` line and summary.json's fast_path."""
