"""`python -m fsdp_recipes.tools.estimator ...`: `fsdp-recipes estimate`, with the same arguments."""

import sys

from fsdp_recipes.tools.estimator.command import main

sys.exit(main())
