"""Running a sans-I/O generator: the one loop every client core is driven by.

A core (a job's waits, a submission, an enqueue, a tier lookup) is a generator that yields what it
needs done (a request for I/O) and is sent the reply, or thrown the error the I/O raised.  It never
touches a socket, so the sync and async clients run the same decisions: each only does the I/O."""

from __future__ import annotations

from typing import Any, AsyncIterator, Generator, Iterator, Optional

Step = Generator[Any, Any, Any]


class Steps:
    """Runs a core's generator for a client: iterate to get each request, answer it with ``reply``
    (or ``fail`` with the error the I/O raised); ``value`` is what the generator returned.

        for op in steps:
            try:
                steps.reply(do(op))      # or: await do(op)
            except Exception as exc:
                steps.fail(exc)
    """

    def __init__(self, gen: Step):
        self._gen = gen
        self._reply: Any = None
        self._error: Optional[BaseException] = None
        self.value: Any = None

    def __iter__(self):
        while True:
            reply, error, self._reply, self._error = self._reply, self._error, None, None
            try:
                op = self._gen.throw(error) if error is not None else self._gen.send(reply)
            except StopIteration as stop:
                self.value = stop.value
                return
            yield op

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, exc: BaseException) -> None:
        self._error = exc


def drive(steps: Steps, do, out: type) -> Iterator[Any]:
    """Run a core with ``do(request)`` as its I/O, yielding the requests of type ``out`` to the caller
    instead (what the core hands out: a job's deltas, a map's results).  What ``do`` raises is thrown
    in, a ``KeyboardInterrupt`` too, so that a core can undo what it asked for (a submission drops its
    subscription); ``steps.value`` is what the core returned."""
    for op in steps:
        if isinstance(op, out):
            yield op
            continue
        try:
            steps.reply(do(op))
        except BaseException as exc:
            steps.fail(exc)


async def adrive(steps: Steps, do, out: type) -> AsyncIterator[Any]:
    """``drive`` with ``await do(request)``: a cancel of the task is thrown in too."""
    for op in steps:
        if isinstance(op, out):
            yield op
            continue
        try:
            steps.reply(await do(op))
        except BaseException as exc:
            steps.fail(exc)


class _Nothing:
    """No request is handed out (``run_steps``)."""


def run_steps(gen: Step, do) -> Any:
    """``drive`` to the end: what the core returns."""
    steps = Steps(gen)
    for _ in drive(steps, do, _Nothing):
        pass
    return steps.value


async def arun_steps(gen: Step, do) -> Any:
    """``adrive`` to the end: what the core returns."""
    steps = Steps(gen)
    async for _ in adrive(steps, do, _Nothing):
        pass
    return steps.value
