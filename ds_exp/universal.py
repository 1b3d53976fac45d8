"""`python -m ds_exp.universal TAG_DIR`: convert a checkpoint to DeepSpeed's universal format ahead of a resume
(ds_exp/checkpoint/universal.py)."""

import sys

from ds_exp.checkpoint.universal import main

if __name__ == "__main__":
    sys.exit(main())
