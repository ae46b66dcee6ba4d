"""A worker's SIGKILL and SIGSTOP as Redis sees them, for an in-process ``Worker``
(tests/integration/test_queue_stateful.py).

Redis sees a worker only through the commands it sends. A script runs whole (Redis
executes a command it has received, whatever becomes of the client), so a signal that
ends or stops a worker process lands, as far as Redis can tell, between two sends of
any of its threads (the worker's and its sender's), or after a send and before its
reply is read: an APPEND that Redis made but whose result the worker never saw. A
``Switch`` on the worker's client makes that happen at a drawn send: ``arm("kill",
after, reply)`` lets ``after`` more sends through, then every further one (from any
thread) raises ``Killed`` before it leaves, or, with ``reply``, the next one is sent
and ``Killed`` is raised once its reply is in (the command ran). ``arm("stop", ...)``
blocks there instead, every thread at its next send, until ``resume()``; what a
stopped thread does between sends (an engine step) no one outside sees.

What this does not model: a kill in the middle of one send (a non-transactional
pipeline half written: only the worker's heartbeat, whose writes are independent).
Killed is a BaseException: the worker's ``except Exception`` (a job's failure) does
not catch it, as no handler runs in a killed process.
"""

from __future__ import annotations

import threading

import redis

from lorapool.connection import LOOP_RETRIES, connect


class Killed(BaseException):
    """The worker process is gone (SIGKILL): nothing it does reaches Redis any more."""


class Switch:
    """The fault a worker's client brings about at a chosen send (see the module)."""

    def __init__(self):
        self._cond = threading.Condition()
        self.fault: str | None = None  # "kill" or "stop" once armed
        self.sends_left = 0  # sends let through before the fault
        self.reply = False  # the fault's send goes out, the fault comes with its reply
        self.fired = False  # the fault has happened (a stop: until resumed)
        self.blocked = 0  # threads held at a send while stopped

    def arm(self, fault: str, after: int, reply: bool) -> None:
        with self._cond:
            self.fault, self.sends_left, self.reply, self.fired = fault, after, reply, False

    def resume(self) -> None:
        """SIGCONT: the stopped threads go on, the fault disarmed."""
        with self._cond:
            self.fault = None
            self._cond.notify_all()

    def wait_stopped(self, timeout: float) -> bool:
        """Whether a thread of the worker is held by the stop (waits up to ``timeout``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.blocked > 0, timeout)

    def before_send(self) -> bool:
        """Called before each send; True: send it, then call ``at_reply`` before its
        reply is read."""
        with self._cond:
            if self.fault is None:
                return False
            if not self.fired and self.sends_left > 0:
                self.sends_left -= 1
                return False
            if not self.fired and self.reply:
                self.fired = True
                return True
            self.fired = True
            self._hit()
            return False

    def at_reply(self) -> None:
        with self._cond:
            self._hit()

    def _hit(self) -> None:
        """Under the lock: raise Killed, or hold this thread while stopped."""
        if self.fault == "kill":
            raise Killed
        self.blocked += 1
        self._cond.notify_all()
        self._cond.wait_for(lambda: self.fault != "stop")
        self.blocked -= 1


class SwitchedConnection(redis.Connection):
    """redis-py's connection, asking its class's ``switch`` at each send."""

    switch: Switch
    _doomed = False

    def send_packed_command(self, command, check_health=True):
        doomed = self.switch.before_send()
        super().send_packed_command(command, check_health)
        self._doomed = self._doomed or doomed

    def read_response(self, *args, **kwargs):
        doomed, self._doomed = self._doomed, False
        try:
            return super().read_response(*args, **kwargs)
        finally:
            if doomed:  # the command ran: killed, its reply is lost; stopped, it waits
                self.switch.at_reply()


def switched_client(url: str, switch: Switch) -> redis.Redis:
    """A worker's client of ``url`` (``connect``'s options, the loop's retries) whose
    sends go through ``switch``."""
    connection_class = type("Switched", (SwitchedConnection,), {"switch": switch})
    return connect(url, retries=LOOP_RETRIES, connection_class=connection_class)
