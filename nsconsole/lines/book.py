"""Every line the console shows (`LineBook`)."""

from __future__ import annotations

from collections.abc import Iterator

from nsconsole.lines.view import LineView


class LineBook:
    """Every line the console shows, by key, in a stable order (by path)."""

    def __init__(self) -> None:
        self.lines: dict[str, LineView] = {}

    def __iter__(self) -> Iterator[LineView]:
        return iter(sorted(self.lines.values(), key=lambda line: line.path))

    def __len__(self) -> int:
        return len(self.lines)

    def get(self, key: str) -> LineView | None:
        return self.lines.get(key)

    def add(self, line: LineView) -> LineView:
        return self.lines.setdefault(line.key, line)
