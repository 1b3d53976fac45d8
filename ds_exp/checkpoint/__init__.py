"""DeepSpeed checkpoints with an engine: saving and rotation (checkpointer), the frozen weights a checkpoint leaves out
(frozen), resume after a layout change through DeepSpeed's universal format (conversion, universal). What is on disk and
what may change is ds_exp.resume's. Layer 8, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model."""
