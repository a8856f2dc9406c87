"""Data: records.py (files -> records), batches.py (tokenize, pack, collate, order),
tokenizer.py."""
