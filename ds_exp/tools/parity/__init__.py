"""`python -m ds_exp.parity A_OVERRIDES -- B_OVERRIDES`: a few steps of two runs from the same weights and data
order, compared step by step (loss, gradient norm) against a tolerance.

sides.py composes and checks both sides (no torch), runs.py launches them as users do, compare.py makes the
verdict and the report, cli.py ties them together.
"""
