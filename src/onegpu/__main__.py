"""`python -m onegpu ...`, which is how launchers start it: `torchrun -m onegpu train ...`."""

import sys

from onegpu.cli.main import main

sys.exit(main())
