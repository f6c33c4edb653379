"""``python -m tessera.rlhf.pipeline STAGE CONFIG --run-dir DIR``: what every rank of ``tessera rlhf`` runs."""

import sys

from tessera.rlhf.pipeline.run import main

sys.exit(main())
