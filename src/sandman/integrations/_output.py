"""A command's output as an agent should see it: its head and its tail, the middle elided.

`exec` keeps the first ``max_output`` bytes of a command's output, but the end
of a long output is what an agent needs most (the error comes last). `run_kept`
streams the output instead and keeps a head and a tail of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from sandman.client import AsyncSandbox

__all__ = ["DEFAULT_KEEP", "DEFAULT_READ_LIMIT", "HeadTail", "Outcome", "run_kept"]

DEFAULT_KEEP = 1_000_000
"""Characters of output kept by default: the first and the last half million."""
DEFAULT_READ_LIMIT = 256 * 2**20
"""Bytes of output read from the sandbox at most by default; the sandbox drops the rest."""


class HeadTail:
    """Keeps the first ``keep // 2`` and the last ``keep - keep // 2`` characters fed to it."""

    def __init__(self, keep: int) -> None:
        if keep < 2:
            raise ValueError(f"keep must be at least 2, got {keep}")
        self._head_room = keep // 2
        self._tail_room = keep - keep // 2
        self._head: list[str] = []
        self._head_len = 0
        self._tail: deque[str] = deque()
        self._tail_len = 0
        self.dropped = 0
        """Characters fed but kept in neither the head nor the tail."""

    def feed(self, text: str) -> None:
        if self._head_len < self._head_room:
            taken = text[: self._head_room - self._head_len]
            self._head.append(taken)
            self._head_len += len(taken)
            text = text[len(taken) :]
        if not text:
            return
        self._tail.append(text)
        self._tail_len += len(text)
        while self._tail_len > self._tail_room:
            excess = self._tail_len - self._tail_room
            first = self._tail[0]
            if len(first) <= excess:
                self._tail.popleft()
                self._tail_len -= len(first)
                self.dropped += len(first)
            else:
                self._tail[0] = first[excess:]
                self._tail_len -= excess
                self.dropped += excess

    def text(self) -> str:
        """What was kept; a line in the middle says how much was elided, if any was."""
        head, tail = "".join(self._head), "".join(self._tail)
        if not self.dropped:
            return head + tail
        return f"{head}\n[... {self.dropped} characters elided ...]\n{tail}"


class Outcome:
    """What `run_kept` saw: the kept output (both streams, interleaved) and how it ended."""

    def __init__(
        self, output: str, exit_code: int, *, timed_out: bool, truncated: bool, elided: int
    ) -> None:
        self.output = output
        self.exit_code = exit_code
        self.timed_out = timed_out
        self.truncated = truncated
        """The sandbox dropped output past the read limit (the tail is then not the end)."""
        self.elided = elided

    def __repr__(self) -> str:
        return (
            f"Outcome(exit_code={self.exit_code}, timed_out={self.timed_out}, "
            f"output={len(self.output)} chars, elided={self.elided})"
        )


async def run_kept(
    sandbox: AsyncSandbox,
    command: str | Sequence[str],
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    user: str | int | None = None,
    keep: int = DEFAULT_KEEP,
    read_limit: int = DEFAULT_READ_LIMIT,
) -> Outcome:
    """Run ``command`` with stdout and stderr merged, keeping the head and tail of its output.

    Output past ``read_limit`` bytes is dropped in the sandbox (``truncated``).
    """
    kept = HeadTail(keep)
    exit_code, timed_out, truncated = -1, False, False
    async with sandbox.exec_stream(
        command, cwd=cwd, env=env, timeout=timeout, user=user, merge_stderr=True,
        max_output=read_limit,
    ) as events:  # fmt: skip
        async for event in events:
            if event.event == "exit":
                exit_code = -1 if event.exit_code is None else event.exit_code
                timed_out, truncated = event.timed_out, event.truncated
            else:
                kept.feed(event.data)
    output = kept.text()
    if truncated:
        output += f"\n[... output past {read_limit} bytes dropped ...]\n"
    return Outcome(output, exit_code, timed_out=timed_out, truncated=truncated, elided=kept.dropped)
