"""Ulysses sequence parallelism (`dist.sequence_parallel_size=N`), DeepSpeed's ALST, in ds_exp's exact step.

The world is dp x N ranks; DeepSpeed's groups are contiguous (ranks [i*N, (i+1)*N) train together), so a rank's place
in its group is rank % N and its data-parallel rank is rank // N. What each part does:

- DeepSpeed: `UlyssesSPAttentionHF.register_with_transformers` makes the groups (the `mpu` handed to
  deepspeed.initialize) and swaps the model's attention function for one that all-to-alls from sequence shards to
  head shards and back. ZeRO then partitions over all dp x N ranks, sums gradients over the N ranks of a group and
  divides by dp.
- ds_exp's data path (not DeepSpeed's DataLoader adapter, whose queue spills shards across optimizer steps and cannot
  be resumed): the resumable sampler is sharded by data-parallel rank, so every rank of a group draws and collates
  the same rows (padded to a multiple of N, position_ids in every batch), and `SequenceShard` keeps this rank's slice
  of the sequence, with the labels shifted on the whole row first (a shard's last token predicts the next shard's
  first).
- The loss: each rank's token-loss sum over its slice, divided by the global batch's label tokens
  (ds_exp/train/step.py): the sum over all ranks is the loss of the global batch, and DeepSpeed's gradient reduction
  makes it exact.
- Packed rows: the wrapped attention runs per document (`isolate_documents`), so documents never see each other.
- Generation runs without sharding (the built model's generate pauses the wrapper): a decode step has one token,
  nothing to shard.

The shared layers know N only as a number: the data-parallel size and the global batch (ds_exp/config/batch.py,
plan.py), the collator's padding and position ids, the sampler's data-parallel ranks and the step's reduction
(ds_exp/train/step.py's `Ranks`).

* settings (light): `SequenceParallelSettings`, a view of dist.sequence_parallel_size and what its checks and hooks
  read (the attention, packing, the micro batch sizes, the model's heads).
* checks (light): the world it divides, the model's heads, the attention and packing it can run, evaluation's batch
  size, DeepSpeed's version, ZeRO-3's reduce_scatter.
* ulysses (`SequenceParallelHooks`, on when N > 1): after the model's config is read, the checks again with the
  launch's world and a hub model's heads (before data and weights); before the weights, DeepSpeed's Ulysses attention
  registered (the mpu for deepspeed.initialize, and each batch's `shard`); after LoRA, the built model checked to run
  the wrapped attention and its generate unsharded; when the run's engine is released, transformers' attention
  table as it was.
"""
