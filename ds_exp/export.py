"""`python -m ds_exp.export CHECKPOINT [DIR]`: a checkpoint in Hugging Face format (ds_exp/exports/)."""

import sys

from ds_exp.exports.cli import export_main

if __name__ == "__main__":
    sys.exit(export_main())
