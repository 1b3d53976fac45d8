"""`python -m ds_exp.report DIR`: the runs under DIR listed (outputs/), or a sweep's report (re)written
(ds_exp/sweeps/runs.py, ds_exp/sweeps/report.py)."""

import sys

from ds_exp.sweeps.runs import main

if __name__ == "__main__":
    sys.exit(main())
