"""Ulysses sequence parallelism (`dist.sequence_parallel_size=N`), DeepSpeed's ALST, in ds_exp's exact step. The
shared layers know N only as a number: the data-parallel size and the global batch (ds_exp/config/batch.py), the
collator's padding and position ids, the sampler's data-parallel ranks, the step's reduction (train/step.py's Ranks).

* settings (light): `SequenceParallelSettings`, a view of the key and what its checks and hooks read.
* checks (light): the world it divides, the model's heads, the attention and packing it can run, evaluation's batch
  size, DeepSpeed's version, ZeRO-3's reduce_scatter.
* ulysses (`SequenceParallelHooks`, on when N > 1): after the model's config, the checks again with the launch's
  world and a hub model's heads; before the weights, DeepSpeed's Ulysses attention registered (the mpu for
  deepspeed.initialize, each batch's `shard`); after LoRA, the model checked to run it and its generate unsharded;
  after the engine's release, transformers' attention table as it was.
"""
