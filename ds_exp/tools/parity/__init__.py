"""`python -m ds_exp.parity A_OVERRIDES -- B_OVERRIDES`: a few steps of two runs from the same weights and data order,
compared step by step against a tolerance (sides: composed and checked; runs: launched; compare: judged)."""
