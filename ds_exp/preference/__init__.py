"""Preference tuning, DeepSpeed-Chat's step 2: DPO (and IPO) on prompt/chosen/rejected rows, and reward models."""
