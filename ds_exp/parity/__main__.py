import sys

from ds_exp.parity.cli import main

sys.exit(main(sys.argv[1:]))
