"""Text data for ``graphforge train``: JSONL in MLX-LM's text / completions / chat shapes
(lines.py), tokenized with a Hugging Face tokenizer.json (tokenizer.py, chat_template.py),
cached on disk (cache.py), cut into rows of token arrays (rows.py) and offered as an
ArraySource (source.py)."""
