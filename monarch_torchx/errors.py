"""User-facing errors: each carries one line that says what went wrong and what to do."""


class MonarchError(RuntimeError):
    """A request we refuse or cannot serve; printed as one line, never as a traceback."""


class PoolNotFound(MonarchError, LookupError):
    pass


class AccessError(MonarchError):
    """This client cannot reach a pool's hosts at all (credentials, RBAC, a refused tunnel).

    Not a host failure: health checks raise it instead of "repairing" healthy hosts.
    """


class HostUnreachable(MonarchError):
    """This client could not talk to one host. Says nothing of whether the host is alive: only
    evidence (``Pool.loss_evidence``) makes a host lost; until then its apps are UNKNOWN."""

    def __init__(self, message: str, index: int = -1, cause: "BaseException | None" = None):
        super().__init__(message)
        self.index = index
        self.cause = cause


class HostLost(MonarchError):
    """This client's way to one host is gone on the engine's word (a Kubernetes pod that is gone
    or not running, behind a port-forward): evidence, unlike ``HostUnreachable``."""

    def __init__(self, message: str, index: int = -1):
        super().__init__(message)
        self.index = index


class StartTimeout(MonarchError):
    """Hosts did not publish their address within the start timeout."""


class HomeUnusable(MonarchError):
    """This user cannot use the registry home (``$MONARCH_TORCHX_HOME``): another user's, not
    writable, or on a read-only file system. Never reported as "corrupt": nothing in it is to
    be removed, another home is to be chosen."""


class CreateInterrupted(KeyboardInterrupt):
    """Ctrl-C while a pool was being created. A KeyboardInterrupt still (whatever catches one
    treats it as one), carrying what the CLI says: ``stopped`` when what the creation had
    started was stopped, else ``monarch-torchx pool stop NAME`` is the command that does it."""

    def __init__(self, pool: str, stopped: bool):
        super().__init__(pool)
        self.pool = pool
        self.stopped = stopped
