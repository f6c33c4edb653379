"""Exceptions shared by every layer of tessera."""

from __future__ import annotations


class TesseraError(Exception):
    """Base class of every error tessera raises on purpose."""


class ConfigError(TesseraError, ValueError):
    """A configuration value is missing, misspelt, of the wrong type or breaks a rule.

    Raised before any process group starts; the message names the key and what is allowed.
    """


class NotAvailableError(TesseraError, NotImplementedError):
    """A configured feature is accepted by the config schema but not built yet."""


class CommError(TesseraError, RuntimeError):
    """A collective or point-to-point operation failed; the message names rank, op and axis.

    ``missing_ranks``: the global ranks that, as far as the other members' progress records
    show, did not arrive at this collective (or entered a different one); empty when none was
    found or the records could not be read.
    """

    missing_ranks: tuple[int, ...] = ()


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not complete within the watchdog timeout."""


class BudgetError(TesseraError, ValueError):
    """A memory budget cannot hold what training needs; the message names the smallest that would."""


class OffloadError(TesseraError, OSError):
    """The offload folder of the disk tier cannot be used (missing, read-only, full)."""


class ToolchainError(TesseraError, RuntimeError):
    """What ``torch.compile`` needs on this machine (a C++ compiler for inductor's CPU kernels,
    triton for its GPU ones) is missing; the message names the fix and the eager switch."""
