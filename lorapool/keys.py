"""Every Redis key name lorapool uses, in one place.

Per-request keys wrap the request id in a hash tag (``{...}``) so that all the
keys of one request land in the same Redis Cluster slot.
"""

from dataclasses import dataclass

DEFAULT_PREFIX = "lorapool"
WORKERS_GROUP = "workers"
AUDIT_GROUP = "audit"
# {p}:dead keeps about this many entries (XADD MAXLEN ~): a dead-lettered request's
# error record also reaches the audit table, so trimming loses only the raw payload.
DEAD_MAX_LEN = 10_000
# A job's priority names the stream it goes to; workers read them in this order, the
# next only with capacity left after the one before (see ``Keys.stream``).
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self):
        if not self.prefix or any(c in self.prefix for c in "{} \n"):
            raise ValueError(f"invalid key prefix {self.prefix!r}")

    @property
    def requests(self) -> str:
        """Stream of jobs; consumer group ``workers``."""
        return f"{self.prefix}:requests"

    @property
    def batch_requests(self) -> str:
        """Stream of batch jobs (group ``workers``): a worker reads it only with capacity
        left after ``requests``, so batch files never starve interactive traffic."""
        return f"{self.prefix}:requests:batch"

    @property
    def streams(self) -> tuple[str, ...]:
        """The job streams, in the order workers read them (``PRIORITIES``)."""
        return tuple(self.stream(p) for p in PRIORITIES)

    def stream(self, priority: str) -> str:
        """The stream of jobs of ``priority`` (one of ``PRIORITIES``)."""
        if priority == "interactive":
            return self.requests
        if priority == "batch":
            return self.batch_requests
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}; got {priority!r}")

    @property
    def dead(self) -> str:
        """Stream of dead-lettered jobs with their reason."""
        return f"{self.prefix}:dead"

    @property
    def audit(self) -> str:
        """Stream of final records for the audit writer; group ``audit``."""
        return f"{self.prefix}:audit"

    @property
    def adapters(self) -> str:
        """Hash: adapter name -> registry record."""
        return f"{self.prefix}:adapters"

    @property
    def adapter_ids(self) -> str:
        """Hash: adapter int id -> adapter name (keeps ids unique)."""
        return f"{self.prefix}:adapter-ids"

    @property
    def model(self) -> str:
        """The pool's base model: {"name", "sha256"} of the first worker (SET NX)."""
        return f"{self.prefix}:model"

    @property
    def workers(self) -> str:
        """Hash: worker id -> heartbeat record."""
        return f"{self.prefix}:workers"

    @property
    def api_keys(self) -> str:
        """Hash: API key id -> its record (tenant, role, sha256 of the key; never the key)."""
        return f"{self.prefix}:api-keys"

    def rate(self, tenant: str, window: int, what: str) -> str:
        """A tenant's count of ``what`` (requests, tokens) in the minute ``window``."""
        return f"{self.prefix}:rate:{tenant}:{window}:{what}"

    def alive(self, worker: str) -> str:
        """A worker's liveness flag: expires a few heartbeats after its last one."""
        return f"{self.prefix}:alive:{worker}"

    def handoff(self, worker: str) -> str:
        """List of entries other workers handed to ``worker`` (adapter affinity): each
        "<stream's position in ``streams``, 1-based> <entry id>"."""
        return f"{self.prefix}:handoff:{worker}"

    def batch(self, batch_id: str) -> str:
        """Hash: one batch file's state (status, counts, files; lorapool/batch/state.py)."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def callback(self, request_id: str) -> str:
        """Set once a request's completion callback is in RQ (lorapool/batch/callbacks.py)."""
        return f"{self.prefix}:callback:{{{request_id}}}"

    def job(self, request_id: str) -> str:
        """Idempotency marker and status of one job."""
        return f"{self.prefix}:job:{{{request_id}}}"

    def out(self, request_id: str) -> str:
        """Chunk log (stream) and live channel (pub/sub) of one request."""
        return f"{self.prefix}:out:{{{request_id}}}"

    def abort(self, request_id: str) -> str:
        """Abort flag of one request, read by whichever worker holds it."""
        return f"{self.prefix}:abort:{{{request_id}}}"
