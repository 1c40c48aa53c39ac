"""User-facing errors: each carries one line that says what went wrong and what to do."""


class MonarchError(RuntimeError):
    """A request we refuse or cannot serve; printed as one line, never as a traceback."""


class PoolNotFound(MonarchError, LookupError):
    pass
