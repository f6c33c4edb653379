"""``python -m tessera.config docs/config.md``: regenerate the field reference in the docs."""

import sys
from pathlib import Path

from tessera.config.reference import render_docs
from tessera.files import write_atomically

target = Path(sys.argv[1])
write_atomically(target, render_docs(target.read_text()))
print(f"wrote the config reference into {target}")
