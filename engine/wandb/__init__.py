"""The W&B mirror of a line's rows.jsonl."""
