"""`python -m hybridmoe ...`: the same dispatcher as the `hybridmoe` command."""
import sys

from .cli import main

sys.exit(main())
