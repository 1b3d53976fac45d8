"""`python -m ds_exp.report SWEEP_DIR`: (re)write a sweep's report (ds_exp/sweeps/report.py)."""

import sys

from ds_exp.sweeps.report import main

if __name__ == "__main__":
    sys.exit(main())
