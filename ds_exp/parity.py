"""`python -m ds_exp.parity A_OVERRIDES -- B_OVERRIDES`: two configurations compared step by step
(ds_exp/tools/parity/)."""

import sys

from ds_exp.tools.parity.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
