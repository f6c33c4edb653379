"""How a run compiles its model: small typed values that the top layer builds from the config's
``compile`` section (``tessera.config.options``)."""

from __future__ import annotations

from dataclasses import dataclass

SCOPES = ("blocks", "model")
BACKENDS = ("inductor", "aot_eager", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """``scope``: ``"blocks"`` compiles each repeated block on its own (regional compilation:
    one graph, compiled once, serves every block of a shape) while the strategies' hooks stay
    eager around it; ``"model"`` compiles the whole forward. ``loss``: the criterion too.
    ``backend``: torch's compiler (``inductor``: generated kernels; ``aot_eager``: the captured
    forward and backward graphs run by eager kernels, for checking a capture); ``mode``,
    ``fullgraph`` (a graph break is an error) and ``dynamic`` are ``torch.compile``'s own."""

    scope: str = "blocks"
    backend: str = "inductor"
    mode: str = "default"
    fullgraph: bool = False
    dynamic: bool | None = False
    loss: bool = False

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("scope", self.scope, SCOPES),
            ("backend", self.backend, BACKENDS),
            ("mode", self.mode, MODES),
        ):
            if value not in allowed:
                raise ValueError(f"compile.{name}={value!r} is not one of: {', '.join(allowed)}")

    def torch_options(self) -> dict[str, object]:
        """The keyword arguments of ``torch.compile``."""
        mode = None if self.mode == "default" or self.backend != "inductor" else self.mode
        return {"backend": self.backend, "mode": mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
