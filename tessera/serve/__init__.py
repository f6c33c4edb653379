"""``tessera serve``: an OpenAI-compatible HTTP server (``app``) over a rank group running
``tessera.inference`` (``ranks``); docs/serving.md."""
