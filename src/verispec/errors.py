"""The error every command turns into one line on stderr and exit code 2.

It lives in its own module so that the subcommands (bench, serve, data, train, export) can raise
it without importing `verispec.cli`, which imports them to build its parser.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user: printed as one line, no traceback."""
