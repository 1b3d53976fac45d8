"""`python -m ds_exp [OVERRIDES]`: train, plan or sweep (ds_exp/launch/cli.py)."""

import sys

from ds_exp.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
