"""`python -m ds_exp.evaluate TARGET TASK...`: lm-eval scores, base model beside tuned (ds_exp/evaluation/)."""

import sys

from ds_exp.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
