"""User-facing errors: each carries one line that says what went wrong and what to do."""


class MonarchError(RuntimeError):
    """A request we refuse or cannot serve; printed as one line, never as a traceback."""


class PoolNotFound(MonarchError, LookupError):
    pass


class AccessError(MonarchError):
    """This client cannot reach a pool's hosts at all (credentials, RBAC, a refused tunnel).

    Not a host failure: health checks raise it instead of "repairing" healthy hosts.
    """
