"""DeepSpeed checkpoints with an engine: saving and rotation, frozen weights left out, resume through DeepSpeed's
universal format (what is on disk is ds_exp.resume's). Layer 8, heavy. May import: the light layers, runtime, model."""
