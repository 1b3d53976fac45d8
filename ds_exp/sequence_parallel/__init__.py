"""Ulysses sequence parallelism (`dist.sequence_parallel_size=N`), DeepSpeed's ALST, in ds_exp's exact step. The shared
layers know N only as a number (data-parallel size, padding, sampler ranks, the step's Ranks).

settings (light): `SequenceParallelSettings`. checks (light): the world, the heads, the attention and packing,
evaluation's batch size, DeepSpeed's version, ZeRO-3's reduce_scatter. ulysses (`SequenceParallelHooks`, on when
N > 1): DeepSpeed's Ulysses attention registered before the weights (the mpu, each batch's `shard`), the model
checked after LoRA, transformers' attention table restored after the release."""
