"""ds_exp: Hydra-configured DeepSpeed supervised fine-tuning of Hugging Face causal language models.

Nothing heavy is imported here: `--help`, `--cfg job` and config validation never import torch or deepspeed.
"""

__version__ = "0.1.0"
