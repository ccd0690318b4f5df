"""Errors a user can cause and act on: the CLI prints them as one line."""


class BatchgenError(Exception):
    """A problem with what the user asked for: the message says what was wrong and what to do."""
