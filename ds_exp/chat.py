"""`python -m ds_exp.chat DIR`: talk to an exported model (ds_exp/tools/use/)."""

import sys

from ds_exp.tools.use.cli import chat_main

if __name__ == "__main__":
    sys.exit(chat_main())
