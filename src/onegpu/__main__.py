"""`python -m onegpu ...`, which is how launchers start it: `torchrun -m onegpu train ...`."""

import sys

from onegpu.cli import main

sys.exit(main())
