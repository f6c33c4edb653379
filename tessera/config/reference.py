"""The field reference of every config key, generated from the schema for docs/config.md.

``python -m tessera.config docs/config.md`` rewrites the generated part of that page.
"""

from __future__ import annotations

import dataclasses
import typing

from tessera.config.loading import type_name
from tessera.config.schema import Config

# ---- the field reference -------------------------------------------------------------------


def reference_markdown() -> str:
    """Markdown tables of every config field: key, type, default and meaning."""
    lines: list[str] = []

    def table(cls: type, prefix: str, doc: str) -> None:
        hints = typing.get_type_hints(cls)
        lines.append(f"### `{prefix.rstrip('.') or 'top level'}`\n")
        if doc:
            lines.append(f"{doc}\n")
        lines.append("| key | type | default | meaning |")
        lines.append("| --- | --- | --- | --- |")
        nested = []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((f, tp))
                continue
            type_cell = type_name(tp).replace("|", "\\|")
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{prefix}{f.name}` | `{type_cell}` | `{default!r}` | {f.metadata['doc']} |")
        lines.append("")
        for f, tp in nested:
            table(tp, f"{prefix}{f.name}.", f.metadata["doc"])  # type: ignore[arg-type]

    table(Config, "", "")
    return "\n".join(lines).rstrip() + "\n"


_BEGIN = "<!-- BEGIN GENERATED: python -m tessera.config docs/config.md -->"
_END = "<!-- END GENERATED -->"


def render_docs(text: str) -> str:
    """``text`` with the part between the generated-reference markers replaced."""
    if _BEGIN not in text or _END not in text:
        raise ValueError("the docs page lacks the generated-reference markers")
    head, rest = text.split(_BEGIN, 1)
    _, tail = rest.split(_END, 1)
    return f"{head}{_BEGIN}\n\n{reference_markdown()}\n{_END}{tail}"
