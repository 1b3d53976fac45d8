"""DeepSpeed checkpoints with an engine: saving (complete only once marked), rotation and loading (checkpointer),
what a checkpoint leaves out (frozen: LoRA's base, taken from the model the run started from, checked to be the same),
and resume anywhere: a checkpoint whose layout changed converted to DeepSpeed's universal format (conversion, in
its own process) and loaded from it (universal). What is on disk and what may change is ds_exp.resume's.

Layer 8, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model.
"""
