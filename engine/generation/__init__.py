"""Generating text from a checkpoint alone: `loading` (the model and the tokenizer a checkpoint
carries), `settings` and `sampling` (temperature and top-p draws from a seeded generator),
`session` (a decoding state carried from call to call), `text` (token ids to text as they come)
and `chat` (turns of a conversation)."""
