"""Data: records.py (files -> records), validate.py (file and chat-message checks with file and
line), batches.py (tokenize, pack, collate, order), tokenizer.py."""
