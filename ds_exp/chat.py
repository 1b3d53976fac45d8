"""`python -m ds_exp.chat DIR`: talk to an exported model (ds_exp/exports/)."""

import sys

from ds_exp.exports.cli import chat_main

if __name__ == "__main__":
    sys.exit(chat_main())
