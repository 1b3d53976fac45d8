"""`python -m ds_exp.parity A_OVERRIDES -- B_OVERRIDES`: a few steps of two runs from the same weights and data order,
compared step by step against a tolerance. sides.py composes and checks both sides (no torch), runs.py launches them,
compare.py judges, cli.py ties them together."""
