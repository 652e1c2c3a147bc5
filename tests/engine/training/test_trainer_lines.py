"""Tiny real data lines and training lines for the trainer tests (helpers, and a test of them).

A local source of a few hundred short jsonl documents, a byte-level BPE of 300 tokens trained on
them, cycles of 5,000 tokens (`at_corpus_end: last_cycle`, so the line ends by itself; the
preparer records sample-order digests at 4096, so a cycle needs more than 4097 tokens), and a
`transformer-tiny` training line on it at seq_len 32, 16 rows per update in micro-batches of 8.
"""

from __future__ import annotations

from pathlib import Path

from helpers.lines import (
    SEQ_LEN,
    TOKENS_PER_UPDATE,
    make_data_line,
)

from datalines import open_data_line


def test_fixture_line_has_several_ready_cycles_and_an_end(tmp_path: Path) -> None:
    data = open_data_line(make_data_line(tmp_path))
    last = data.last_cycle()
    assert last is not None and last >= 1
    for index in range(last + 1):
        assert data.cycle_ready(index)
        assert data.cycle(index).num_samples(SEQ_LEN) > TOKENS_PER_UPDATE // SEQ_LEN
