"""Plain-text tables and a progress line for the bench."""

from __future__ import annotations

from typing import TextIO

import msgspec


class Table(msgspec.Struct, frozen=True, kw_only=True):
    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""

    def render(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

        def line(cells: list[str]) -> str:
            return "  ".join(
                cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
            )

        parts = [self.title, line(self.headers), line(["-" * w for w in widths])]
        parts += [line(row) for row in self.rows]
        if self.note:
            parts.append(self.note)
        return "\n".join(parts)


class Progress:
    """A one-line progress indicator on stderr: ``[section] step i/n: what``. Decoration
    only: without a stream (``2>&-``), or once writing to it fails (its reader has gone),
    it says nothing and the command goes on."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._tty = stream is not None and stream.isatty()
        self._section = ""

    def section(self, name: str) -> None:
        self._section = name

    def step(self, index: int, total: int, what: str) -> None:
        width = 20
        filled = width * index // max(total, 1)
        text = f"[{self._section}] [{'#' * filled}{'.' * (width - filled)}] {index}/{total} {what}"
        self._write("\r\033[K" + text if self._tty else text + "\n")

    def done(self) -> None:
        if self._tty:
            self._write("\r\033[K")

    def _write(self, text: str) -> None:
        if self._stream is None:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError:
            self._stream = None
