"""``python -m tessera.rlhf_pipeline STAGE CONFIG --run-dir DIR``: what every rank of ``tessera rlhf`` runs."""

import sys

from tessera.rlhf_pipeline.run import main

sys.exit(main())
